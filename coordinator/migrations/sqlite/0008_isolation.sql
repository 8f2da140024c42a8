-- cairn coordinator metadata, schema 8: a workspace reaches only its own data.
--
-- Keys belong to a lineage (a workspace and the forks made from it), not to
-- the tenant: a run token is handed its own lineage's key only, so a
-- stolen URL of another lineage decrypts nothing and another lineage's
-- keyed blob ids cannot be computed. Workspaces made before this schema
-- keep the tenant's keys (lineage NULL), so their checkpoints still restore.
ALTER TABLE workspaces ADD COLUMN lineage TEXT;

CREATE TABLE lineage_keys (
    lineage    TEXT   NOT NULL,
    key_id     TEXT   NOT NULL,
    secret     BLOB   NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (lineage, key_id)
);

-- The packs a workspace may reference, sign URLs for and deduplicate
-- against: those its own commits recorded and those of the checkpoint it
-- was forked from. Nothing another workspace uploads is ever in it, so
-- another workspace can neither be read through a commit nor poison this
-- one's dedup index.
CREATE TABLE workspace_packs (
    workspace_id TEXT NOT NULL REFERENCES workspaces (id),
    tenant       TEXT NOT NULL,
    pack_id      TEXT NOT NULL,
    PRIMARY KEY (workspace_id, pack_id),
    FOREIGN KEY (tenant, pack_id) REFERENCES packs (tenant, id)
);

CREATE INDEX workspace_packs_by_pack ON workspace_packs (tenant, pack_id);

INSERT INTO workspace_packs (workspace_id, tenant, pack_id)
SELECT DISTINCT c.workspace_id, cp.tenant, cp.pack_id
FROM checkpoint_packs cp JOIN checkpoints c ON c.id = cp.checkpoint_id;

-- A blob may now sit in several packs (two workspaces that may not share
-- one upload it each), so the index is keyed by blob and pack.
CREATE TABLE blobs_v8 (
    tenant  TEXT NOT NULL,
    blob_id BLOB NOT NULL,
    pack_id TEXT NOT NULL,
    PRIMARY KEY (tenant, blob_id, pack_id),
    FOREIGN KEY (tenant, pack_id) REFERENCES packs (tenant, id)
);

INSERT INTO blobs_v8 (tenant, blob_id, pack_id) SELECT tenant, blob_id, pack_id FROM blobs;
DROP INDEX blobs_by_pack;
DROP TABLE blobs;
ALTER TABLE blobs_v8 RENAME TO blobs;
CREATE INDEX blobs_by_pack ON blobs (tenant, pack_id);
