-- The PostgreSQL schema: the same tables, columns and indexes as SQLite's
-- migrations 0001-0010 applied in order (BYTEA for BLOB, identity columns for
-- AUTOINCREMENT, BIGINT for every integer). A later change gets the same
-- number in both directories, written for each database.

CREATE TABLE tenants (
    id             TEXT   PRIMARY KEY,
    -- The key new checkpoints are sealed with (a row of tenant_keys).
    current_key_id TEXT   NOT NULL,
    created_at     BIGINT NOT NULL
);
CREATE TABLE tenant_keys (
    tenant     TEXT   NOT NULL REFERENCES tenants (id),
    key_id     TEXT   NOT NULL,
    secret     BYTEA   NOT NULL,
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
    -- The key lineage its checkpoints are sealed in (shared with its forks).
    lineage       TEXT,
    finished_at   BIGINT,
    -- Retention overrides (NULL: the server's default).
    keep_last     BIGINT,
    finished_retention_ms BIGINT,
    UNIQUE (tenant, name)
);
CREATE INDEX workspaces_by_tenant ON workspaces (tenant, id);
CREATE TABLE packs (
    tenant       TEXT   NOT NULL REFERENCES tenants (id),
    id           TEXT   NOT NULL,
    kind         TEXT   NOT NULL CHECK (kind IN ('meta', 'data')),
    size         BIGINT NOT NULL,
    index_offset BIGINT NOT NULL,
    index_length BIGINT NOT NULL,
    created_at   BIGINT NOT NULL,
    lost_at      BIGINT,
    -- Set when garbage collection found nothing referencing it.
    condemned_at BIGINT,
    -- Set when compaction replaced it.
    superseded_at BIGINT,
    PRIMARY KEY (tenant, id)
);
CREATE TABLE checkpoints (
    id             TEXT    PRIMARY KEY,
    workspace_id   TEXT    NOT NULL REFERENCES workspaces (id),
    sequence       BIGINT  NOT NULL,
    parent_id      TEXT,
    reason         TEXT    NOT NULL,
    generation     BIGINT  NOT NULL,
    format_version BIGINT  NOT NULL,
    root_tree      BYTEA    NOT NULL,
    key_id         TEXT    NOT NULL,
    -- Protobuf encodings: cairn.v1.CheckpointStats, a cairn.v1.Checkpoint
    -- holding only repos, warnings and harness.
    stats          BYTEA    NOT NULL,
    details        BYTEA    NOT NULL,
    pack_count     BIGINT  NOT NULL,
    stored_bytes   BIGINT  NOT NULL,
    created_at     BIGINT  NOT NULL,
    request_id     TEXT,
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
CREATE TABLE hosts (
    id                TEXT   PRIMARY KEY,
    tenant            TEXT   NOT NULL REFERENCES tenants (id),
    name              TEXT   NOT NULL,
    -- JSON object of the placement labels.
    labels            TEXT   NOT NULL,
    slots             BIGINT NOT NULL,
    driver            TEXT   NOT NULL,
    -- What the operator set; losing the host does not change it, so a
    -- cordoned host that comes back is still cordoned.
    admin_state       TEXT   NOT NULL CHECK (admin_state IN ('ready', 'cordoned', 'draining')),
    -- Set when the host missed heartbeats for longer than the lease; cleared
    -- when it registers again.
    lost_at           BIGINT,
    registered_at     BIGINT NOT NULL,
    last_heartbeat_at BIGINT NOT NULL,
    -- Set when the host agent says it is shutting down; cleared when it
    -- registers again. No assignments go to a stopping host.
    stopping_at       BIGINT,
    kept_workspaces   TEXT   NOT NULL DEFAULT '[]'
);
CREATE INDEX hosts_by_tenant ON hosts (tenant, id);
CREATE TABLE tokens (
    token_hash   BYTEA   PRIMARY KEY,
    tenant       TEXT   NOT NULL REFERENCES tenants (id),
    scope        TEXT   NOT NULL CHECK (scope IN ('admin', 'client', 'host', 'run')),
    -- Set for run tokens: the only workspace they may touch.
    workspace_id TEXT   REFERENCES workspaces (id),
    description  TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT,
    run_id       TEXT,
    attempt      BIGINT,
    id           TEXT,
    revoked_at   BIGINT,
    host_id      TEXT   REFERENCES hosts (id)
);
CREATE TABLE runs (
    id                     TEXT   PRIMARY KEY,
    tenant                 TEXT   NOT NULL REFERENCES tenants (id),
    workspace_id           TEXT   NOT NULL REFERENCES workspaces (id),
    station                TEXT   NOT NULL,
    prompt                 TEXT   NOT NULL,
    -- Protobuf encoding of a cairn.v1.Run holding only harness, labels and repos.
    spec                   BYTEA   NOT NULL,
    image                  TEXT   NOT NULL,
    hold_ms                BIGINT NOT NULL,
    checkpoint_interval_ms BIGINT NOT NULL,
    max_attempts           BIGINT NOT NULL,
    state                  TEXT   NOT NULL CHECK (state IN ('queued', 'assigned', 'starting', 'running',
                                  'waiting', 'suspended', 'succeeded', 'failed', 'cancelled')),
    state_reason           TEXT   NOT NULL,
    question               TEXT   NOT NULL DEFAULT '',
    summary                TEXT   NOT NULL DEFAULT '',
    harness_session_id     TEXT   NOT NULL DEFAULT '',
    last_checkpoint_id     TEXT   NOT NULL DEFAULT '',
    -- Set while waiting: when the held sandbox is released.
    hold_until             BIGINT,
    -- Number of the newest attempt (0: never assigned).
    attempt_count          BIGINT NOT NULL DEFAULT 0,
    -- Attempts that ended on an infrastructure failure (host lost, runner
    -- crashed); the run fails when they reach max_attempts.
    failed_attempts        BIGINT NOT NULL DEFAULT 0,
    last_event_sequence    BIGINT NOT NULL DEFAULT 0,
    created_at             BIGINT NOT NULL,
    updated_at             BIGINT NOT NULL
);
CREATE INDEX runs_by_tenant ON runs (tenant, id);
CREATE INDEX runs_by_workspace ON runs (workspace_id, id);
CREATE INDEX runs_by_state ON runs (state, id);
CREATE TABLE attempts (
    run_id                 TEXT   NOT NULL REFERENCES runs (id),
    number                 BIGINT NOT NULL,
    -- The workspace generation this attempt's checkpoints commit at.
    generation             BIGINT NOT NULL,
    host_id                TEXT   NOT NULL REFERENCES hosts (id),
    sandbox_id             TEXT   NOT NULL UNIQUE,
    state                  TEXT   NOT NULL CHECK (state IN ('assigned', 'starting', 'running', 'waiting', 'ended')),
    started_at             BIGINT NOT NULL,
    ended_at               BIGINT,
    end_reason             TEXT   NOT NULL DEFAULT '',
    -- What the prepare step did, in words ("; "-separated).
    prepare                TEXT   NOT NULL DEFAULT '',
    restored_checkpoint_id TEXT   NOT NULL DEFAULT '',
    -- The outcome the runner reported (NULL: none yet).
    outcome                TEXT,
    -- Why the host was ordered to destroy the sandbox (NULL: no order).
    destroy_reason         TEXT,
    -- The sandbox as the host last reported it (NULL: never reported).
    sandbox_state          TEXT,
    exit_code              BIGINT,
    -- When the sandbox stopped occupying a slot.
    sandbox_gone_at        BIGINT,
    PRIMARY KEY (run_id, number)
);
CREATE INDEX attempts_by_host ON attempts (host_id, sandbox_gone_at);
CREATE TABLE run_events (
    run_id        TEXT   NOT NULL REFERENCES runs (id),
    sequence      BIGINT NOT NULL,
    at            BIGINT NOT NULL,
    -- The run's state after the event.
    state         TEXT   NOT NULL,
    reason        TEXT   NOT NULL,
    host_id       TEXT   NOT NULL DEFAULT '',
    attempt       BIGINT NOT NULL DEFAULT 0,
    generation    BIGINT NOT NULL DEFAULT 0,
    checkpoint_id TEXT   NOT NULL DEFAULT '',
    detail        TEXT   NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, sequence)
);
CREATE TABLE run_inputs (
    run_id      TEXT   NOT NULL REFERENCES runs (id),
    id          BIGINT NOT NULL,
    kind        TEXT   NOT NULL,
    text        TEXT   NOT NULL,
    created_at  BIGINT NOT NULL,
    consumed_at BIGINT,
    -- The attempt whose harness heard it.
    consumed_by BIGINT,
    PRIMARY KEY (run_id, id)
);
CREATE TABLE workspace_sessions (
    workspace_id TEXT   NOT NULL REFERENCES workspaces (id),
    station      TEXT   NOT NULL,
    harness      TEXT   NOT NULL,
    session_id   TEXT   NOT NULL,
    run_id       TEXT   NOT NULL REFERENCES runs (id),
    updated_at   BIGINT NOT NULL,
    fork_pending BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (workspace_id, station)
);
CREATE TABLE workspace_messages (
    id           BIGINT  GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    workspace_id TEXT    NOT NULL REFERENCES workspaces (id),
    station      TEXT    NOT NULL,
    text         TEXT    NOT NULL,
    created_at   BIGINT  NOT NULL,
    run_id       TEXT    REFERENCES runs (id),
    input_id     BIGINT,
    -- How many times a run gave it back unheard.
    given_back   BIGINT  NOT NULL DEFAULT 0
);
CREATE INDEX workspace_messages_by_workspace ON workspace_messages (workspace_id, station, id);
CREATE INDEX workspace_messages_by_run ON workspace_messages (run_id, input_id);
CREATE TABLE handoff_notes (
    id            BIGINT  GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    workspace_id  TEXT    NOT NULL REFERENCES workspaces (id),
    run_id        TEXT    NOT NULL REFERENCES runs (id),
    station       TEXT    NOT NULL,
    attempt       BIGINT  NOT NULL,
    harness       TEXT    NOT NULL,
    outcome       TEXT    NOT NULL CHECK (outcome IN ('succeeded', 'failed', 'interrupted')),
    checkpoint_id TEXT    NOT NULL DEFAULT '',
    summary       TEXT    NOT NULL,
    changed       TEXT    NOT NULL,
    checked       TEXT    NOT NULL,
    uncertain     TEXT    NOT NULL,
    next_action   TEXT    NOT NULL,
    composed      TEXT    NOT NULL DEFAULT '',
    created_at    BIGINT  NOT NULL,
    UNIQUE (workspace_id, run_id)
);
CREATE INDEX handoff_notes_by_workspace ON handoff_notes (workspace_id, id);
CREATE TABLE run_laid_files (
    run_id  TEXT NOT NULL REFERENCES runs (id),
    path    TEXT NOT NULL,
    content BYTEA NOT NULL,
    PRIMARY KEY (run_id, path)
);
CREATE UNIQUE INDEX tokens_by_id ON tokens (id);
CREATE TABLE lineage_keys (
    lineage    TEXT   NOT NULL,
    key_id     TEXT   NOT NULL,
    secret     BYTEA   NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (lineage, key_id)
);
CREATE TABLE workspace_packs (
    workspace_id TEXT NOT NULL REFERENCES workspaces (id),
    tenant       TEXT NOT NULL,
    pack_id      TEXT NOT NULL,
    PRIMARY KEY (workspace_id, pack_id),
    FOREIGN KEY (tenant, pack_id) REFERENCES packs (tenant, id)
);
CREATE INDEX workspace_packs_by_pack ON workspace_packs (tenant, pack_id);
CREATE TABLE blobs (
    tenant  TEXT NOT NULL,
    blob_id BYTEA NOT NULL,
    pack_id TEXT NOT NULL,
    PRIMARY KEY (tenant, blob_id, pack_id),
    FOREIGN KEY (tenant, pack_id) REFERENCES packs (tenant, id)
);
CREATE INDEX blobs_by_pack ON blobs (tenant, pack_id);
CREATE UNIQUE INDEX checkpoints_by_request ON checkpoints (workspace_id, request_id);
CREATE TABLE checkpoint_pins (
    checkpoint_id TEXT   NOT NULL REFERENCES checkpoints (id),
    reason        TEXT   NOT NULL,
    until_at      BIGINT,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (checkpoint_id, reason)
);
CREATE INDEX packs_by_condemned ON packs (condemned_at);
CREATE TABLE pack_deletions (
    tenant     TEXT   NOT NULL,
    pack_id    TEXT   NOT NULL,
    size       BIGINT NOT NULL,
    started_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, pack_id)
);
