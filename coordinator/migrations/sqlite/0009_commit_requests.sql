-- cairn coordinator metadata, schema 9: idempotent commits.
--
-- A runner names each commit it means (CommitCheckpointRequest.request_id)
-- and sends the same name again when a call was cut off before its answer;
-- the workspace records it with the checkpoint, so the retry is answered
-- with that checkpoint instead of making a second one. NULL for commits
-- that named none (NULLs are distinct in a unique index).
ALTER TABLE checkpoints ADD COLUMN request_id TEXT;

CREATE UNIQUE INDEX checkpoints_by_request ON checkpoints (workspace_id, request_id);
