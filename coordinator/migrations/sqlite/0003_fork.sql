-- cairn coordinator metadata, schema 3: forked workspaces.
--
-- A station session copied from the workspace a fork was made from. The
-- first run at the station forks that conversation (the source and every
-- fork must not write to one transcript); the session its harness reports
-- then replaces the row and clears the mark. 1: fork pending, 0: not.
ALTER TABLE workspace_sessions ADD COLUMN fork_pending BIGINT NOT NULL DEFAULT 0;
