"""What every arm of `make bench` runs: the engine settings on this CPU and the prompts."""

from __future__ import annotations

from typing import Any

# On this CPU: a full vLLM batch (256 sequences) and room for it in the KV cache.
CPU_BENCH = {
    "THINKBATCH_MAX_NUM_SEQS": "256",
    "THINKBATCH_CPU_KVCACHE_SPACE_GIB": "2",
    "THINKBATCH_MAX_MODEL_LEN": "512",
}


def prompts(n: int, round_no: int = 0) -> list[dict[str, Any]]:
    """n prompts; each round's differ from the first tokens on, so no round reuses another's
    prefix cache."""
    topics = [
        "continuous batching", "PagedAttention", "the KV cache", "left padding",
        "speculative decoding", "prefix caching", "tensor parallelism", "quantization",
    ]  # fmt: skip
    return [
        {
            "custom_id": f"b{k}",
            "messages": [
                {
                    "role": "user",
                    "content": f"Round {round_no}, question {k}: "
                    f"explain {topics[k % len(topics)]}.",
                }
            ],
        }
        for k in range(n)
    ]
