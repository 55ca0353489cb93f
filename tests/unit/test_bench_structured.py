"""The structured part of `make bench`: what each arm asks the engine to compile."""

from __future__ import annotations

from typing import Any

from bench.structured import job_body
from thinkbatch.sampling import resolve_sampling


def specs(body: dict[str, Any]) -> list[str | None]:
    """Each item's constraint as the engine gets it (its compiled-grammar cache key)."""
    out = []
    for item in body["items"]:
        s = resolve_sampling(body["params"], item.get("params"), default_max_tokens=64)
        out.append(None if s.structured is None else str(s.structured.spec))
    return out


def test_the_job_schema_is_one_grammar_and_item_schemas_one_per_item() -> None:
    plain, job, items = (job_body(arm, 20, 3000) for arm in ("plain", "job schema", "item schemas"))
    assert specs(plain) == [None] * 20
    assert len(set(specs(job))) == 1 and None not in specs(job)
    assert len(set(specs(items))) == 20
    # Same prompts in each arm, and schemas of one length: the arms differ only in the cache.
    assert plain["items"][0]["messages"] == items["items"][0]["messages"]
    assert {len(s or "") for s in specs(items)} == {len(specs(job)[0] or "")}


def test_rounds_compile_new_grammars() -> None:
    assert set(specs(job_body("job schema", 3, 3000))).isdisjoint(
        specs(job_body("job schema", 3, 3010))
    )
