-- The write lock (a transaction-level advisory lock) is keyed by the
-- schema's name from this version on; earlier builds used one key in every
-- schema. A replica of an earlier build beside one of this build would not
-- be excluded by its writes. This migration changes no table: it is here so
-- that an earlier build, which does not know it, refuses to start on a
-- schema a replica of this build has migrated.
SELECT 1;
