"""Structured answers in the job system (`make bench`'s `structured` part): what a JSON schema
costs, and what compiling it once per job buys.

One API and one worker on the vLLM engine run the same items (thinking on, greedy, answers
ending at EOS) in three arms, one job each per round, timed submit to `completed`:

* plain: no constraint;
* job schema: one `response_format` in the job's params, so the engine compiles one grammar for
  the job and every item hits its compiled-grammar cache;
* item schemas: the same schema in each item's params with one enum value unique to the item,
  so every item compiles a grammar of its own.

job schema / plain is the cost of a schema, job schema / item schemas what the cache buys.
Within a round the arms' prompts are the same, so greedy decoding gives them the same thinking
(job schema and item schemas the same tokens); each round's prompts and schemas are new, so no
round reuses another's compiled grammars. A later arm of a round may find the first arm's
prompt blocks in the prefix cache where blocks are small (16 tokens on a GPU; these ~30-token
prompts fill none of the CPU backend's 128-token blocks): the arms' order turns each round.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.cpu import wait_engines_idle
from bench.system_arm import job_round
from bench.system_arm import start_system
from devstack.stack import Stack
from thinkbatch.settings import Settings

ITEMS = 500
# Room for the thinking and the answer: the tiny model ends both well within it.
MAX_TOKENS = 128
ARMS = ("plain", "job schema", "item schemas")
SHOWN_FAILURES = 5


def claims(n: int, round_no: int) -> list[dict[str, Any]]:
    """n items to grade. The demo model closes its thinking on every one of these, greedy; on
    some of bench/workload.py's questions it ends at EOS inside the thinking, an empty answer
    that no schema can hold."""
    topics = [
        "continuous batching", "PagedAttention", "the KV cache", "left padding",
        "speculative decoding", "prefix caching", "tensor parallelism", "quantization",
    ]  # fmt: skip
    return [
        {
            "custom_id": f"c{k}",
            "messages": [
                {
                    "role": "user",
                    "content": f"Round {round_no}, claim {k}: {topics[k % len(topics)]} "
                    "helps batch inference. Grade the claim.",
                }
            ],
        }
        for k in range(n)
    ]


def tag_of(round_index: int, k: int) -> str:
    """The schema's unique enum value, item k's (k < 999) or, at 999, the job's. Of one length
    in every arm: the model may pick it, and then the grammar forces every one of its tokens."""
    return f"{round_index:02d}-{k:03d}"


def grade_schema(tag: str) -> dict[str, Any]:
    """Enums and a boolean, nothing else allowed: a free string or key could let the model
    wander to max_tokens. `tag` is one enum value, so that each tag compiles its own grammar."""
    return {
        "type": "object",
        "properties": {
            "verdict": {"enum": ["yes", "no", f"unsure-{tag}"]},
            "score": {"enum": [1, 2, 3, 4, 5]},
            "sure": {"type": "boolean"},
        },
        "required": ["verdict", "score", "sure"],
        "additionalProperties": False,
    }


def response_format(tag: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "grade", "schema": grade_schema(tag)}}


def job_body(arm: str, n: int, round_index: int) -> dict[str, Any]:
    """The job an arm submits in a round: the round's prompts, and schemas no other job has."""
    items = claims(n, 3000 + round_index)
    params: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0}
    if arm == "job schema":
        params["response_format"] = response_format(tag_of(round_index, 999))
    elif arm == "item schemas":
        for k, item in enumerate(items):
            item["params"] = {"response_format": response_format(tag_of(round_index, k))}
    return {"items": items, "params": params}


def run_structured(
    env: dict[str, str], settings: Settings, database_url: str, logs: Path, rounds_n: int
) -> dict[str, list[dict[str, Any]]]:
    """`rounds_n` rounds of every arm on a stack of its own; each round's failed items as
    text."""
    stack = Stack(env, logs)
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        client, _, port = start_system(stack, settings, None)
        db = sa.create_engine(database_url)
        for r in range(rounds_n):
            for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
                wait_engines_idle()
                result = job_round(client, db, job_body(arm, ITEMS, r), port)
                failed = []
                if result["succeeded"] != ITEMS:
                    url = f"/v1/jobs/{result['job']['id']}/results"
                    lines = client.get(url, params={"status": "failed"}).raise_for_status()
                    failed = [failure(json.loads(x)) for x in lines.text.splitlines()]
                rounds[arm].append(result | {"failed": failed[:SHOWN_FAILURES]})
        db.dispose()
        return rounds
    finally:
        stack.stop_all()


def failure(item: dict[str, Any]) -> str:
    """A failed item in one line: why, and where its answer had got to."""
    answer = (item.get("answer") or "")[:80]
    return f"{item['custom_id']}: {item['error']}, finish_reason {item['finish_reason']}, " + (
        f"answer {answer!r}"
    )


def median_of(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def print_structured(rounds: dict[str, list[dict[str, Any]]]) -> None:
    n = len(rounds[ARMS[0]])
    print(
        f"-- structured answers: {ITEMS} items, thinking on, greedy, max_tokens {MAX_TOKENS}, "
        f"{n} rounds, arms interleaved (order turning), submit to completed --"
    )
    print(
        f"{'arm':13} {'items/s':>8} {'out tok/s':>10} {'tok/item':>8} {'seconds':>8}  "
        "(median; every round)"
    )
    for arm in ARMS:
        median = sorted(rounds[arm], key=lambda r: r["seconds"])[n // 2]
        secs = median["seconds"]
        each = " ".join(f"{r['seconds']:.2f}" for r in rounds[arm])
        print(
            f"{arm:13} {ITEMS / secs:8.1f} {median['output_tokens'] / secs:10.0f} "
            f"{median['output_tokens'] / ITEMS:8.1f} {secs:8.2f}  ({each})"
        )
    for label, top, bottom in (
        ("job schema / plain (the cost of a schema)", "job schema", "plain"),
        ("job schema / item schemas (what one grammar per job buys)", "job schema", "item schemas"),
    ):
        # items/s of `top` over `bottom` in the same round: the rounds' seconds inverted
        paired = [
            b["seconds"] / t["seconds"] for t, b in zip(rounds[top], rounds[bottom], strict=True)
        ]
        print(
            f"{label}: {median_of(paired):.3f} items/s, median of rounds "
            f"({' '.join(f'{x:.2f}' for x in paired)})"
        )
    for arm in ARMS:
        done = sum(r["succeeded"] for r in rounds[arm])
        print(f"{arm} items succeeded: {done} of {ITEMS * n}")
        for r in rounds[arm]:
            for line in r["failed"]:
                print(f"  failed: {line}")
