-- cairn coordinator metadata, schema 7: the token lifecycle.
--
-- Same portability rules as the earlier schemas (BIGINT milliseconds, TEXT
-- columns, no AUTOINCREMENT). Each ALTER adds one nullable column, which
-- both SQLite and PostgreSQL do without rewriting the table.

-- A token's public id (`tok-…`), for listing and revoking it without its
-- text. Admin, client and host tokens get one when they are created; rows
-- older than this schema get one when the coordinator opens the database.
-- Run tokens have none: they live and die with their attempt.
ALTER TABLE tokens ADD COLUMN id TEXT;

-- Set when an operator revoked the token; it is refused from then on.
ALTER TABLE tokens ADD COLUMN revoked_at BIGINT;

-- For host tokens: the one host this token may act as. NULL on a host
-- token is an enrollment token, which may only register a new host.
ALTER TABLE tokens ADD COLUMN host_id TEXT REFERENCES hosts (id);

CREATE UNIQUE INDEX tokens_by_id ON tokens (id);
