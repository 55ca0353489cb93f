from __future__ import annotations

import json

import pytest

from tests.e2e.test_vocabulary_vllm import FORMAT
from tests.e2e.test_vocabulary_vllm import WEATHER
from tests.stacks import Client
from tests.stacks import RunningStack

pytestmark = pytest.mark.e2e


def test_native(vllm_stack: RunningStack) -> None:
    msg = [{"role": "user", "content": "Is the sky blue?"}]
    items = [
        {
            "custom_id": "schema",
            "messages": msg,
            "params": {"response_format": FORMAT, "max_tokens": 96},
        },
        {
            "custom_id": "schema-off",
            "messages": msg,
            "params": {"response_format": FORMAT, "enable_thinking": False},
        },
        {"custom_id": "raw", "prompt": "Answer in JSON:", "params": {"response_format": FORMAT}},
        {
            "custom_id": "budget",
            "messages": msg,
            "params": {"response_format": FORMAT, "reasoning_effort": "low"},
        },
        {
            "custom_id": "n3",
            "messages": msg,
            "params": {"n": 3, "temperature": 1.0, "max_tokens": 64},
        },
        {
            "custom_id": "lp",
            "messages": msg,
            "params": {"logprobs": True, "top_logprobs": 2, "max_tokens": 64},
        },
        {
            "custom_id": "tool",
            "messages": msg,
            "params": {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
        },
        {
            "custom_id": "req",
            "messages": msg,
            "params": {"tools": [WEATHER], "tool_choice": "required"},
        },
        {"custom_id": "auto", "messages": msg, "params": {"tools": [WEATHER], "max_tokens": 96}},
        {
            "custom_id": "regex",
            "messages": msg,
            "params": {"structured_outputs": {"regex": "[a-c]{3}"}},
        },
        {
            "custom_id": "choice",
            "messages": msg,
            "params": {"structured_outputs": {"choice": ["red", "green"]}},
        },
        {
            "custom_id": "grammar",
            "messages": msg,
            "params": {"structured_outputs": {"grammar": "root ::= ("}},
        },
        {
            "custom_id": "uniq",
            "messages": msg,
            "params": {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
        },
        {"custom_id": "bias", "messages": msg, "params": {"logit_bias": {"99999": 5}}},
        {
            "custom_id": "stopids",
            "messages": msg,
            "params": {
                "stop_token_ids": [5],
                "min_p": 0.1,
                "include_stop_str_in_output": True,
                "stop": ["the"],
            },
        },
    ]
    with Client(None, vllm_stack.key(), uds=None) if False else None or _client(vllm_stack) as c:
        job = c.submit(items, params={"max_tokens": 128})
        c.wait(job["id"], timeout=300)
        for it in c.all_items(job["id"]):
            print(
                json.dumps(
                    {
                        k: it[k]
                        for k in (
                            "custom_id",
                            "status",
                            "thinking",
                            "answer",
                            "answer_json",
                            "tool_calls",
                            "finish_reason",
                            "usage",
                            "error",
                        )
                    }
                )[:600]
            )
            if it["choices"]:
                print(
                    "   choices:", [(c["answer"][:40], c["thinking"][:20]) for c in it["choices"]]
                )
            if it["logprobs"]:
                print("   logprobs:", it["logprobs"][:3])


def _client(stack):
    from urllib.parse import urlparse

    port = urlparse(stack.base_url).port
    return Client(port, stack.key())
