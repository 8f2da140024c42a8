-- cairn coordinator metadata, schema 2: runs on hosts.
--
-- Same portability rules as schema 1 (BIGINT milliseconds, ON CONFLICT, no
-- AUTOINCREMENT). Run and attempt states are the words of
-- cairn_proto::runs (RunState, AttemptState, SandboxState, Outcome).

-- A pack that a commit found missing from the store. Its blobs no longer
-- count as stored (FindMissingBlobs reports them missing, so they are
-- uploaded again); a commit that uploads the pack again clears the mark.
ALTER TABLE packs ADD COLUMN lost_at BIGINT;

-- Run tokens are bound to one attempt of one run.
ALTER TABLE tokens ADD COLUMN run_id TEXT;
ALTER TABLE tokens ADD COLUMN attempt BIGINT;

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
    stopping_at       BIGINT
);

CREATE INDEX hosts_by_tenant ON hosts (tenant, id);

CREATE TABLE runs (
    id                     TEXT   PRIMARY KEY,
    tenant                 TEXT   NOT NULL REFERENCES tenants (id),
    workspace_id           TEXT   NOT NULL REFERENCES workspaces (id),
    station                TEXT   NOT NULL,
    prompt                 TEXT   NOT NULL,
    -- Protobuf encoding of a cairn.v1.Run holding only harness, labels and repos.
    spec                   BLOB   NOT NULL,
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

-- Messages for a run's harness (answers to its questions). An input is
-- consumed once a runner reports that the harness heard it; until then every
-- new attempt gets it again (a duplicate beats a loss).
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

-- The harness conversation of each station of a workspace, resumed by the
-- next run at that station.
CREATE TABLE workspace_sessions (
    workspace_id TEXT   NOT NULL REFERENCES workspaces (id),
    station      TEXT   NOT NULL,
    harness      TEXT   NOT NULL,
    session_id   TEXT   NOT NULL,
    run_id       TEXT   NOT NULL REFERENCES runs (id),
    updated_at   BIGINT NOT NULL,
    PRIMARY KEY (workspace_id, station)
);
