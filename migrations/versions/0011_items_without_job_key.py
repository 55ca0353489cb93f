"""A submission's items are not checked row by row against their job

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 08:00:00

The foreign key of `items.job_id` checked each row a submission's COPY wrote against `jobs`,
a locking lookup per row queued as a trigger event per row: about 3 us of Postgres for each
item stored (a COPY of 20,000 items here: 11.1 us a row with the key, 7.4 without). Items are
only ever written by the submission's COPY, in the transaction that inserted their job just
before; the check could not fail. What the key also did, deleting a deleted job's items, is a
statement trigger on `jobs` now (the items' own delete trigger then takes their results), as
`item_results` lost its keys in 0008.

Dropping the key scans nothing, but it needs both tables to itself for a moment: it waits
at most 10 s for the transactions in flight (a long download, say) and fails rather than hold
every poll and store behind it; run it again then. `TRUNCATE jobs` truncates the items and
their results too, as the key's CASCADE did. Putting the key back (down) deletes any item
whose job is gone, then checks every row without holding off writes (NOT VALID, VALIDATE).
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

UP = """
SET LOCAL lock_timeout = '10s';
ALTER TABLE items DROP CONSTRAINT fk_items_job_id_jobs;
CREATE FUNCTION tb_jobs_delete_items() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM items WHERE job_id IN (SELECT id FROM old_rows);
    RETURN NULL;
END
$$;
CREATE TRIGGER tb_jobs_delete_items AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_jobs_delete_items();
CREATE FUNCTION tb_jobs_truncate_items() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE items, item_results;
    RETURN NULL;
END
$$;
CREATE TRIGGER tb_jobs_truncate_items AFTER TRUNCATE ON jobs
    FOR EACH STATEMENT EXECUTE FUNCTION tb_jobs_truncate_items();
"""

DOWN = """
DROP TRIGGER tb_jobs_truncate_items ON jobs;
DROP FUNCTION tb_jobs_truncate_items();
DROP TRIGGER tb_jobs_delete_items ON jobs;
DROP FUNCTION tb_jobs_delete_items();
DELETE FROM items AS i WHERE NOT EXISTS (SELECT 1 FROM jobs AS j WHERE j.id = i.job_id);
ALTER TABLE items ADD CONSTRAINT fk_items_job_id_jobs
    FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE NOT VALID;
ALTER TABLE items VALIDATE CONSTRAINT fk_items_job_id_jobs;
"""


def upgrade() -> None:
    op.execute(UP)


def downgrade() -> None:
    op.execute(DOWN)
