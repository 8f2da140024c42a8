-- cairn coordinator metadata, schema 1.
--
-- Written to port to PostgreSQL: BIGINT for counters and sizes, times as
-- BIGINT milliseconds since the Unix epoch, BLOB for raw bytes (BYTEA there),
-- ON CONFLICT for idempotent inserts, no AUTOINCREMENT or rowid tricks.

CREATE TABLE tenants (
    id             TEXT   PRIMARY KEY,
    -- The key new checkpoints are sealed with (a row of tenant_keys).
    current_key_id TEXT   NOT NULL,
    created_at     BIGINT NOT NULL
);

-- Key material of a tenant. Old keys stay: checkpoints name the key they
-- were sealed with, and restores need it for as long as they exist.
CREATE TABLE tenant_keys (
    tenant     TEXT   NOT NULL REFERENCES tenants (id),
    key_id     TEXT   NOT NULL,
    secret     BLOB   NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, key_id)
);

CREATE TABLE workspaces (
    id            TEXT   PRIMARY KEY,
    tenant        TEXT   NOT NULL REFERENCES tenants (id),
    -- NULL when unnamed; names are unique per tenant.
    name          TEXT,
    state         TEXT   NOT NULL CHECK (state IN ('active', 'finished', 'deleted')),
    generation    BIGINT NOT NULL,
    -- Sequence number of the newest checkpoint ever committed (0: none yet).
    last_sequence BIGINT NOT NULL DEFAULT 0,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL,
    UNIQUE (tenant, name)
);

CREATE INDEX workspaces_by_tenant ON workspaces (tenant, id);

-- Bearer tokens, stored as the SHA-256 of the token text.
CREATE TABLE tokens (
    token_hash   BLOB   PRIMARY KEY,
    tenant       TEXT   NOT NULL REFERENCES tenants (id),
    scope        TEXT   NOT NULL CHECK (scope IN ('admin', 'client', 'host', 'run')),
    -- Set for run tokens: the only workspace they may touch.
    workspace_id TEXT   REFERENCES workspaces (id),
    description  TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT
);

-- Packs known to be in the store: recorded by the commit that uploaded them.
CREATE TABLE packs (
    tenant       TEXT   NOT NULL REFERENCES tenants (id),
    id           TEXT   NOT NULL,
    kind         TEXT   NOT NULL CHECK (kind IN ('meta', 'data')),
    size         BIGINT NOT NULL,
    index_offset BIGINT NOT NULL,
    index_length BIGINT NOT NULL,
    created_at   BIGINT NOT NULL,
    PRIMARY KEY (tenant, id)
);

-- Which pack holds a blob. The first pack to record a blob keeps it.
CREATE TABLE blobs (
    tenant  TEXT NOT NULL,
    blob_id BLOB NOT NULL,
    pack_id TEXT NOT NULL,
    PRIMARY KEY (tenant, blob_id),
    FOREIGN KEY (tenant, pack_id) REFERENCES packs (tenant, id)
);

CREATE INDEX blobs_by_pack ON blobs (tenant, pack_id);

CREATE TABLE checkpoints (
    id             TEXT    PRIMARY KEY,
    workspace_id   TEXT    NOT NULL REFERENCES workspaces (id),
    sequence       BIGINT  NOT NULL,
    parent_id      TEXT,
    reason         TEXT    NOT NULL,
    generation     BIGINT  NOT NULL,
    format_version INTEGER NOT NULL,
    root_tree      BLOB    NOT NULL,
    key_id         TEXT    NOT NULL,
    -- Protobuf encodings: cairn.v1.CheckpointStats, a cairn.v1.Checkpoint
    -- holding only repos, warnings and harness.
    stats          BLOB    NOT NULL,
    details        BLOB    NOT NULL,
    pack_count     BIGINT  NOT NULL,
    stored_bytes   BIGINT  NOT NULL,
    created_at     BIGINT  NOT NULL,
    UNIQUE (workspace_id, sequence)
);

CREATE TABLE checkpoint_packs (
    checkpoint_id TEXT NOT NULL REFERENCES checkpoints (id),
    tenant        TEXT NOT NULL,
    pack_id       TEXT NOT NULL,
    PRIMARY KEY (checkpoint_id, pack_id),
    FOREIGN KEY (tenant, pack_id) REFERENCES packs (tenant, id)
);

CREATE INDEX checkpoint_packs_by_pack ON checkpoint_packs (tenant, pack_id);
