-- cairn coordinator metadata, schema 4: chat messages to workspaces.
--
-- A message a client sent to a workspace station. While `run_id` is NULL it
-- is pending: the next run created at the station takes it as an input.
-- Otherwise it is input `input_id` of run `run_id`, heard once that input is
-- consumed. A run that ends without its harness hearing it gives it back
-- (run_id and input_id cleared again).
CREATE TABLE workspace_messages (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
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
