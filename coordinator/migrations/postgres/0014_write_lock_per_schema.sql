-- From this version on, the write lock (a transaction-level advisory lock)
-- is keyed by a digest of the schema's name, and run changes are announced
-- on a channel named after that digest; earlier builds used one lock key in
-- every schema and a channel named after the configured schema. A replica
-- of an earlier build beside one of this build would neither be excluded
-- by its writes nor hear its announcements. This migration changes no
-- table: it is here so that an earlier build, which does not know it,
-- refuses to start on a schema a replica of this build has migrated.
SELECT 1;
