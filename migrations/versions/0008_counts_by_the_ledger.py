"""A job's counts are added by the statements that end items; results carry no per-row checks

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 23:00:00

What one item costs Postgres, measured with `python -m bench.ledger_alone` (EXPLAIN ANALYZE of
one claim and one store):

- `tb_items_counts_update`, a statement trigger with transition tables, copied every updated
  row of `items`, claims included (whose pending -> running moves change no count), and wrote
  the job's row in the middle of a store, whose lock the store then held to its commit. The
  ledger now adds the counts itself (thinkbatch/ledger/counts.py), from what each ending
  statement returns, as the last write before the commit. `tb_results_usage` goes the same way.
  The insert and delete triggers stay: a submission's COPY is one statement per job, and
  nothing deletes items but an operator.
- The foreign keys of `item_results` checked each stored row against `items` and `jobs`, by a
  locking lookup per row and key: a quarter of a store's time. A result is only ever written by
  the store's one statement, joined to the item row it has just updated under the fence, whose
  `job_id` it copies; the checks could not fail. What they also did, deleting a deleted item's
  result, is a statement trigger on `items` now.

The counts on the jobs' rows are already right when this runs: nothing to backfill.
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

UP = """
DROP TRIGGER tb_items_counts_update ON items;
DROP TRIGGER tb_results_usage_insert ON item_results;
DROP FUNCTION tb_results_usage();
ALTER TABLE item_results DROP CONSTRAINT fk_item_results_item_id_items;
ALTER TABLE item_results DROP CONSTRAINT fk_item_results_job_id_jobs;

CREATE FUNCTION tb_items_delete_results() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM item_results WHERE item_id IN (SELECT id FROM old_rows);
    RETURN NULL;
END
$$;
CREATE TRIGGER tb_items_delete_results AFTER DELETE ON items
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_items_delete_results();
"""

DOWN = """
DROP TRIGGER tb_items_delete_results ON items;
DROP FUNCTION tb_items_delete_results();
ALTER TABLE item_results ADD CONSTRAINT fk_item_results_job_id_jobs
    FOREIGN KEY (job_id) REFERENCES jobs (id) ON DELETE CASCADE;
ALTER TABLE item_results ADD CONSTRAINT fk_item_results_item_id_items
    FOREIGN KEY (item_id) REFERENCES items (id) ON DELETE CASCADE;
CREATE FUNCTION tb_results_usage() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs AS j SET
        prompt_tokens = j.prompt_tokens + u.prompt_tokens,
        completion_tokens = j.completion_tokens + u.completion_tokens,
        reasoning_tokens = j.reasoning_tokens + u.reasoning_tokens
    FROM (
        SELECT job_id, sum(prompt_tokens) AS prompt_tokens,
            sum(completion_tokens) AS completion_tokens, sum(reasoning_tokens) AS reasoning_tokens
        FROM new_rows GROUP BY job_id
    ) AS u
    WHERE j.id = u.job_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER tb_results_usage_insert AFTER INSERT ON item_results
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_results_usage();
CREATE TRIGGER tb_items_counts_update AFTER UPDATE ON items
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tb_items_counts();
"""


def upgrade() -> None:
    op.execute(UP)


def downgrade() -> None:
    op.execute(DOWN)
