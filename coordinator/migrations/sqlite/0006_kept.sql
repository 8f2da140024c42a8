-- cairn coordinator metadata, schema 6: workspaces whose tree a host keeps.
--
-- A JSON array of workspace ids, as the host's last heartbeat listed them.
-- The scheduler sends a queued run of one of them to that host when it has
-- a free slot.
ALTER TABLE hosts ADD COLUMN kept_workspaces TEXT NOT NULL DEFAULT '[]';
