-- cairn coordinator metadata, schema 5: stations.
--
-- Same portability rules as the earlier schemas (BIGINT milliseconds, TEXT
-- and BLOB columns, ON CONFLICT).

-- A run's handoff note: what changed, what was checked, what is uncertain,
-- the next action, as its runner reported it with the outcome (the agent's
-- words where it gave them, else composed from facts). One per run in a
-- workspace; a later report of the same run replaces it. A fork gets copies
-- of the notes of the work it was forked from (their run_id stays the
-- source's run). `composed` lists the fields the runner filled in,
-- comma-separated.
CREATE TABLE handoff_notes (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
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

-- The files a run lays in its workspace for its station before the harness
-- starts (CreateRunRequest.lay): each attempt's runner gets them.
CREATE TABLE run_laid_files (
    run_id  TEXT NOT NULL REFERENCES runs (id),
    path    TEXT NOT NULL,
    content BLOB NOT NULL,
    PRIMARY KEY (run_id, path)
);
