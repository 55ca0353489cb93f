"""Claims in prefix order (CLAIM_ORDER=prefix, thinkbatch/jobs/prefix.py): a job's items whose
prompts begin alike are claimed together, whatever order the job listed them in; items that
share nothing keep the job's order; CLAIM_ORDER=submitted keeps it for every item; and the
claim reads the order from an index rather than sorting the job's pending items."""

from __future__ import annotations

import random
import uuid
from typing import Any

import sqlalchemy as sa
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from tests.helpers import submit_job
from thinkbatch import ledger
from thinkbatch.jobs.prefix import LEVEL_MIN
from thinkbatch.jobs.prefix import prefix_key
from thinkbatch.ledger import ModelFilter
from thinkbatch.settings import Settings

SYSTEM = "You answer questions about the document below, citing its lines. " * 3


def document(k: int) -> str:
    rng = random.Random(k)  # noqa: S311 - text to run, not a secret
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    return f"Document {k}: " + " ".join(rng.choice(words) for _ in range(120))


def doc_items(docs: int, questions: int, seed: int = 7) -> list[dict[str, Any]]:
    """`docs` documents asked `questions` questions each, listed in a shuffled order (as a
    batch file built question by question would list them)."""
    items = [
        {
            "custom_id": f"d{d}-q{q}",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{document(d)}\n\nQuestion {q}: what is line {q}?"},
            ],
        }
        for d in range(docs)
        for q in range(questions)
    ]
    random.Random(seed).shuffle(items)  # noqa: S311 - an order to test, not a secret
    return items


def claim_all(
    db: sa.Engine, job_id: uuid.UUID, n: int, models: ModelFilter | None = None
) -> list[ledger.Claimed]:
    claimed: list[ledger.Claimed] = []
    while True:
        with db.begin() as conn:
            chunk = ledger.claim(conn, job_id, owner="w", n=n, lease_s=60, models=models)
        if not chunk:
            return claimed
        claimed += chunk


def doc_of(custom_id: str) -> str:
    return custom_id.split("-")[0]


def runs(labels: list[str]) -> list[str]:
    """The labels with repeats next to each other collapsed: each label once if contiguous."""
    return [label for k, label in enumerate(labels) if k == 0 or labels[k - 1] != label]


def test_a_documents_questions_are_claimed_together(db: sa.Engine, settings: Settings) -> None:
    items = doc_items(docs=12, questions=5)
    job_id = submit_job(db, settings, {"items": items})
    claimed = claim_all(db, job_id, n=7)
    docs = [doc_of(c.custom_id) for c in claimed]
    assert len(claimed) == 60
    # Each document's five questions in one run: the order the job listed them in (shuffled)
    # would have spread them over the whole job.
    assert len(runs(docs)) == 12, runs(docs)
    listed = [doc_of(i["custom_id"]) for i in items]
    assert len(runs(listed)) > 40
    # Within a document: the job's order.
    for d in set(docs):
        seqs = [c.seq for c in claimed if doc_of(c.custom_id) == d]
        assert seqs == sorted(seqs)


def test_submitted_order_keeps_the_jobs_order(db: sa.Engine, settings: Settings) -> None:
    submitted = settings.model_copy(update={"claim_order": "submitted"})
    job_id = submit_job(db, submitted, {"items": doc_items(docs=6, questions=4)})
    claimed = claim_all(db, job_id, n=7)
    assert [c.seq for c in claimed] == list(range(24))
    with db.connect() as conn:
        keys = conn.execute(sa.text("SELECT DISTINCT prefix_key FROM items")).scalars().all()
    assert keys == [None]


def test_items_that_share_nothing_keep_the_jobs_order(db: sa.Engine, settings: Settings) -> None:
    # Short, unrelated prompts: nothing the prefix cache could keep, so nothing to reorder.
    items = [{"custom_id": f"i{k}", "prompt": f"Say {k} in words."} for k in range(30)]
    job_id = submit_job(db, settings, {"items": items})
    assert [c.seq for c in claim_all(db, job_id, n=4)] == list(range(30))


def test_a_mixed_jobs_items_of_one_model_are_claimed_in_prefix_order(
    db: sa.Engine, settings: Settings
) -> None:
    served = settings.model_copy(update={"served_models": [settings.model_name, "tiny-b"]})
    items = doc_items(docs=8, questions=4)
    for k, item in enumerate(items):
        if k % 2:
            item["model"] = "tiny-b"
    job_id = submit_job(db, served, {"items": items})
    only_b = ModelFilter.of(settings.model_name, [settings.model_name, "tiny-b"], ["tiny-b"])
    assert only_b.kind == "named_one"
    claimed = claim_all(db, job_id, n=3, models=only_b)
    assert {c.model for c in claimed} == {"tiny-b"} and len(claimed) == 16
    docs = [doc_of(c.custom_id) for c in claimed]
    assert len(runs(docs)) == len(set(docs))


def test_the_claim_reads_its_order_from_an_index(db: sa.Engine, settings: Settings) -> None:
    """However large the job, a claim of one name walks one range of an index in claim order
    and stops after `n` items: a sort, or a filter on the model, would read every pending item
    of the job at every claim."""
    served = settings.model_copy(update={"served_models": [settings.model_name, "tiny-b"]})
    items = doc_items(docs=200, questions=10)
    for item in items[::3]:
        item["model"] = "tiny-b"
    job_id = submit_job(db, served, {"items": items})
    with db.begin() as conn:
        conn.execute(sa.text("ANALYZE items"))
        # A worker's claims run as prepared statements: after five, on a generic plan, which
        # knows neither the job nor the model.
        for mode in ("force_custom_plan", "force_generic_plan"):
            conn.execute(sa.text(f"SET LOCAL plan_cache_mode = {mode}"))
            for model, arm in ((None, "own"), ("tiny-b", "named")):
                sql = ledger.claims._CLAIM[arm].text
                params: dict[str, Any] = {"job_id": job_id, "owner": "w", "lease_s": 60, "n": 64}
                if model:
                    params["model"] = model
                plan = "\n".join(conn.execute(sa.text("EXPLAIN " + sql), params).scalars())
                scan = plan[plan.index("Index Scan using ix_items_pending ") :]
                # One name is one range: the model is a condition of the index, not a filter.
                assert "model" in scan.split("Index Cond:")[1].split("\n")[0], plan
                assert "Sort" not in plan, plan


# The key itself: a property over any texts, not one example.
_ALPHABET = st.sampled_from("ab")  # two letters: long shared beginnings are common


@hypothesis_settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(
        st.builds(
            lambda head, tail: head + tail,
            st.sampled_from(["", "x" * 100, "x" * 300, "y" * 700]),
            st.text(_ALPHABET, max_size=900),
        ),
        min_size=2,
        max_size=40,
    )
)
def test_texts_sharing_a_level_are_contiguous_in_key_order(texts: list[str]) -> None:
    """Sorted by (key, seq), the texts that share their first L bytes (L a level, each text
    longer than it) are next to each other, for every level L."""
    data = [t.encode() for t in texts]
    keys = [prefix_key(None, None, d) for d in data]
    order = sorted(range(len(data)), key=lambda k: (keys[k], k))
    head = len(b"\x00\x00")  # what prefix_key puts before the text: no model, no tools
    level = LEVEL_MIN
    while level <= 2048:
        cut = level - head
        groups = [
            data[k][:cut] if len(data[k]) + head > level else None for k in order
        ]  # None: too short to be in a group of this level
        seen: set[bytes] = set()
        previous: bytes | None = None
        for group in groups:
            if group is not None and group != previous:
                assert group not in seen, (level, texts)
                seen.add(group)
            previous = group
        level *= 2


def test_what_the_key_reads() -> None:
    text = b"z" * 1000
    # Model and tools come first: they are where a rendered prompt starts.
    assert prefix_key("m", None, text) != prefix_key(None, None, text)
    assert prefix_key(None, b'[{"type":"function"}]', text) != prefix_key(None, None, text)
    # A text of at most LEVEL_MIN bytes (with its two separators) has nothing to order by.
    assert prefix_key(None, None, b"q" * (LEVEL_MIN - 2)) == b""
    # One CRC per level the text outlasts: 128, 256, 512 for 1,002 bytes.
    assert len(prefix_key(None, None, text)) == 3 * 4
    # Texts that differ at byte 700 share the levels below it and differ from the next one.
    a = prefix_key(None, None, b"z" * 700 + b"a" * 800)
    b = prefix_key(None, None, b"z" * 700 + b"b" * 800)
    assert len(a) == len(b) == 4 * 4  # 128, 256, 512, 1024
    assert a[:12] == b[:12] and a[12:] != b[12:]
