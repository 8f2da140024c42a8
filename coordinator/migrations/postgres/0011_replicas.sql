-- Several coordinators on one database.

-- Leases one replica holds at a time ("leader": the scheduler and the
-- garbage collector). A holder renews its lease well before expires_at
-- (milliseconds since the epoch); another replica takes it after.
CREATE TABLE leases (
    name       TEXT   PRIMARY KEY,
    holder     TEXT   NOT NULL,
    expires_at BIGINT NOT NULL
);

-- Keys every replica must share (the run-token key). The first replica to
-- start writes its own; the others use the stored one.
CREATE TABLE shared_keys (
    name       TEXT   PRIMARY KEY,
    value      BYTEA   NOT NULL,
    created_at BIGINT NOT NULL
);
