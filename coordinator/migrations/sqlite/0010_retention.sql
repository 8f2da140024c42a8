-- cairn coordinator metadata, schema 10: retention, deletion and garbage
-- collection.
--
-- When a workspace was finished (it expires a retention period later), and
-- its own retention settings (NULL: the server's defaults).
ALTER TABLE workspaces ADD COLUMN finished_at BIGINT;
ALTER TABLE workspaces ADD COLUMN keep_last BIGINT;
ALTER TABLE workspaces ADD COLUMN finished_retention_ms BIGINT;

-- Pins keep a checkpoint past its workspace's retention: until until_at,
-- or until unpinned when it is NULL. One pin per checkpoint and reason.
CREATE TABLE checkpoint_pins (
    checkpoint_id TEXT   NOT NULL REFERENCES checkpoints (id),
    reason        TEXT   NOT NULL,
    until_at      BIGINT,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (checkpoint_id, reason)
);

-- When garbage collection first found the pack referenced by no
-- checkpoint (NULL: referenced, or not looked at since). A commit that
-- references it again clears it; it is swept a grace period after.
ALTER TABLE packs ADD COLUMN condemned_at BIGINT;

CREATE INDEX packs_by_condemned ON packs (condemned_at);

-- When compaction replaced the pack with packs of its live blobs (NULL:
-- not replaced). New commits may no longer reference it or deduplicate
-- against it (they are told the pack is missing and find its blobs in
-- the new packs); checkpoints that still reference it keep it.
ALTER TABLE packs ADD COLUMN superseded_at BIGINT;

-- Packs whose object is being deleted from the store. The row is written
-- (and the pack's records removed) in one transaction before the object is
-- deleted, and removed after: a commit that names such a pack is refused
-- as missing, and a sweep cut short finishes the deletion next time.
CREATE TABLE pack_deletions (
    tenant     TEXT   NOT NULL,
    pack_id    TEXT   NOT NULL,
    size       BIGINT NOT NULL,
    started_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, pack_id)
);
