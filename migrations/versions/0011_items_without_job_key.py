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

Dropping the key takes a brief lock on both tables and scans nothing; putting it back (down)
checks every row.
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

UP = """
ALTER TABLE items DROP CONSTRAINT fk_items_job_id_jobs;
CREATE FUNCTION tb_jobs_delete_items() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM items WHERE job_id IN (SELECT id FROM old_rows);
    RETURN NULL;
END
$$;
CREATE TRIGGER tb_jobs_delete_items AFTER DELETE ON jobs
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_jobs_delete_items();
"""

DOWN = """
DROP TRIGGER tb_jobs_delete_items ON jobs;
DROP FUNCTION tb_jobs_delete_items();
ALTER TABLE items ADD CONSTRAINT fk_items_job_id_jobs
    FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE;
"""


def upgrade() -> None:
    op.execute(UP)


def downgrade() -> None:
    op.execute(DOWN)
