-- Text compares byte by byte, as it does on SQLite.
--
-- Every text column here holds ids, names, states or JSON. Under a
-- database's linguistic collation (en_US.UTF-8, even C.UTF-8 on
-- PostgreSQL 15) each comparison of an index lookup calls strcoll, and
-- ORDER BY id sorts differently from SQLite, so pages of a listing
-- would not be the same on the two. The "C" collation compares bytes:
-- cheaper, and the order SQLite gives. Changing a column's collation
-- rebuilds its indexes; the rows are not rewritten.
DO $$
DECLARE
    col record;
BEGIN
    FOR col IN
        SELECT c.table_name, c.column_name
        FROM information_schema.columns c
        JOIN information_schema.tables t
          ON t.table_schema = c.table_schema AND t.table_name = c.table_name
        WHERE c.table_schema = current_schema()
          AND t.table_type = 'BASE TABLE'
          AND c.data_type = 'text'
          AND c.table_name NOT LIKE '\_sqlx%'
          AND c.collation_name IS DISTINCT FROM 'C'
        ORDER BY c.table_name, c.ordinal_position
    LOOP
        EXECUTE format('ALTER TABLE %I ALTER COLUMN %I TYPE TEXT COLLATE "C"',
                       col.table_name, col.column_name);
    END LOOP;
END $$;
