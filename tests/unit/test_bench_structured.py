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
    plain, job, items = (job_body(arm, 20, 0) for arm in ("plain", "job schema", "item schemas"))
    assert specs(plain) == [None] * 20
    assert len(set(specs(job))) == 1 and None not in specs(job)
    assert len(set(specs(items))) == 20 and specs(job)[0] not in specs(items)
    # The same prompts in each arm, and schemas of one length: the arms differ in the cache only.
    prompts = [[i["messages"] for i in body["items"]] for body in (plain, job, items)]
    assert prompts[0] == prompts[1] == prompts[2]
    assert {len(s or "") for s in specs(items)} == {len(specs(job)[0] or "")}


def test_rounds_compile_new_grammars() -> None:
    first, second = (job_body("item schemas", 3, r) for r in (0, 1))
    assert set(specs(first)).isdisjoint(specs(second))
    assert first["items"][0]["messages"] != second["items"][0]["messages"]
