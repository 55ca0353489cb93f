"""Hostile and malformed request bodies: each gets a 4xx in the one envelope, with `param`
naming the field at fault, nothing is stored, and nothing but the error reaches the logs.

Set HOSTILE_CASES_TABLE=<file> to write the table of cases and the statuses they got (markdown).
Content-Type, slow uploads, query-string syntax and 405s are the HTTP layer's tests.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import ROOT
from tests.helpers import TENANT
from tests.helpers import keyed_client
from tests.helpers import make_key
from thinkbatch import guard
from thinkbatch.errors import InputError
from thinkbatch.settings import Settings

SECRET = "PROMPT-TEXT-7f3a"  # in every prompt below: must never reach a log line
MAX_BYTES = 4 * 1024 * 1024
ITEM = {"custom_id": "a", "prompt": SECRET}
GOOD = b'{"items":[{"prompt":"' + SECRET.encode() + b'"}]'  # without the closing brace


def job(**fields: Any) -> dict[str, Any]:
    return {"items": [ITEM], **fields}


def params(**values: Any) -> dict[str, Any]:
    return {"items": [{**ITEM, "params": values}]}


def item(**fields: Any) -> dict[str, Any]:
    return {"items": [{"custom_id": "a", **fields}]}


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def raw_prompt(text: bytes) -> bytes:
    """A body whose prompt is the given bytes, as they are (escapes and all)."""
    return b'{"items":[{"prompt":"' + SECRET.encode() + text + b'"}]}'


# (name, request, status, param, words in the message). A request is a dict (sent as JSON),
# bytes (sent as they are) or ("GET", path).
Case = tuple[str, Any, int, str | None, str]
CASES: list[Case] = [
    # --- 1. nesting ---------------------------------------------------------------------------
    (
        "metadata 33 levels",
        b"{" + GOOD[1:] + b',"metadata":{"a":' + nested(32) + b"}}",
        400,
        "metadata.a" + "[0]" * 30,
        "deeper than 32",
    ),
    (
        "metadata 10,000 levels (100,000: in a subprocess below)",
        b'{"metadata":{"a":' + nested(10_000) + b"}," + GOOD[1:] + b"}",
        400,
        "metadata.a" + "[0]" * 30,
        "deeper than 32",
    ),
    (
        "objects nested in metadata",
        b'{"metadata":' + b'{"k":' * 40 + b"1" + b"}" * 41,
        400,
        "metadata" + ".k" * 31,
        "deeper than 32",
    ),
    (
        "nesting in an item's prompt",
        b'{"items":[{"prompt":' + nested(50) + b"}]}",
        400,
        "items[0].prompt" + "[0]" * 29,
        "deeper than 32",
    ),
    (
        "nesting in params",
        b'{"params":{"stop":' + nested(40) + b"}," + GOOD[1:] + b"}",
        400,
        "params.stop" + "[0]" * 30,
        "deeper than 32",
    ),
    (
        "nesting in an unknown field",
        b'{"x":' + nested(40) + b"}",
        400,
        "x" + "[0]" * 31,
        "deeper than 32",
    ),
    # --- 2. values the engine refuses ---------------------------------------------------------
    (
        "temperature 3",
        params(temperature=3.0),
        400,
        "items[0].params.temperature",
        "less than or equal to 2",
    ),
    (
        "temperature just above 2",
        params(temperature=2.0000001),
        400,
        "items[0].params.temperature",
        "less than or equal to 2",
    ),
    ("job temperature 10", job(params={"temperature": 10}), 400, "params.temperature", "2"),
    (
        "temperature 0.001 (engine would clamp)",
        params(temperature=0.001),
        400,
        "items[0].params.temperature",
        "at least 0.01",
    ),
    (
        "temperature negative",
        params(temperature=-0.1),
        400,
        "items[0].params.temperature",
        "greater than or equal to 0",
    ),
    ("top_p 0", params(top_p=0), 400, "items[0].params.top_p", "greater than 0"),
    ("top_p 1.5", params(top_p=1.5), 400, "items[0].params.top_p", "less than or equal to 1"),
    ("top_k -2", params(top_k=-2), 400, "items[0].params.top_k", "greater than or equal to -1"),
    ("top_k 1.5", params(top_k=1.5), 400, "items[0].params.top_k", "valid integer"),
    (
        "presence_penalty 2.5",
        params(presence_penalty=2.5),
        400,
        "items[0].params.presence_penalty",
        "less than or equal to 2",
    ),
    (
        "presence_penalty -3",
        params(presence_penalty=-3),
        400,
        "items[0].params.presence_penalty",
        "greater than or equal to -2",
    ),
    (
        "repetition_penalty 0",
        params(repetition_penalty=0),
        400,
        "items[0].params.repetition_penalty",
        "greater than or equal to 0.01",
    ),
    (
        "max_tokens 0",
        params(max_tokens=0),
        400,
        "items[0].params.max_tokens",
        "greater than or equal to 1",
    ),
    (
        "max_tokens as a float",
        params(max_tokens=5.0),
        400,
        "items[0].params.max_tokens",
        "valid integer",
    ),
    (
        "max_tokens above the cap",
        params(max_tokens=10**6),
        400,
        "items[0].params.max_tokens",
        "above the cap",
    ),
    (
        "seed -1 (engine: no seed)",
        params(seed=-1),
        400,
        "items[0].params.seed",
        "greater than or equal to 0",
    ),
    ('stop ""', params(stop=""), 400, "items[0].params.stop", "non-empty"),
    ('stop [""]', params(stop=[""]), 400, "items[0].params.stop[0]", "non-empty"),
    ('stop ["a", ""]', params(stop=["a", ""]), 400, "items[0].params.stop[1]", "non-empty"),
    ("stop [5]", params(stop=[5]), 400, "items[0].params.stop[0]", "valid string"),
    ("stop 17 strings", params(stop=["s"] * 17), 400, "items[0].params.stop", "at most 16"),
    ("stop 257 characters", params(stop="x" * 257), 400, "items[0].params.stop", "at most 256"),
    (
        "temperature as a string",
        params(temperature="1"),
        400,
        "items[0].params.temperature",
        "valid number",
    ),
    ("unknown sampling parameter", params(mirostat=0.1), 400, "items[0].params.mirostat", "Extra"),
    # --- the request vocabulary: answer constraints bounded before anything compiles ----------
    (
        "a schema nested 10,000 deep",
        b'{"items": [{"prompt": "x", "params": {"response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "s", "schema": '
        + b'{"items": ' * 10_000
        + b"{}"
        + b"}" * 10_000
        + b"}}}}]}",
        400,
        "items[0].params.response_format.json_schema.schema" + ".items" * 26,
        "nested deeper than",
    ),
    (
        "a 1 MB regex",
        params(structured_outputs={"regex": "a" * 1_000_000}),
        400,
        "items[0].params.structured_outputs",
        "MAX_GRAMMAR_CHARS",
    ),
    (
        "a schema that is not a schema",
        params(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": 5}},
            }
        ),
        400,
        "items[0].params.response_format.json_schema.schema",
        "not a valid JSON Schema",
    ),  # fmt: skip
    (
        "129 tools",
        params(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
        400,
        "items[0].params.tools",
        "at most 128",
    ),  # fmt: skip
    (
        "a logit_bias of 1025 entries",
        params(logit_bias={str(i): 1 for i in range(1025)}),
        400,
        "items[0].params.logit_bias",
        "at most 1024",
    ),
    ("n 1000", params(n=1000), 400, "items[0].params.n", "less than or equal to 128"),
    # --- 4. NUL ---------------------------------------------------------------------------------
    ("NUL in a prompt", item(prompt=SECRET + "\x00"), 400, "items[0].prompt", "NUL"),
    (
        "NUL in message content",
        {"items": [{"messages": [{"role": "user", "content": SECRET + "\x00"}]}]},
        400,
        "items[0].messages[0].content",
        "NUL",
    ),
    (
        "NUL in a role",
        {"items": [{"messages": [{"role": "user\x00", "content": SECRET}]}]},
        400,
        "items[0].messages[0].role",
        "NUL",
    ),
    (
        "NUL in custom_id",
        {"items": [{"custom_id": "a\x00", "prompt": SECRET}]},
        400,
        "items[0].custom_id",
        "NUL",
    ),
    ("NUL in a metadata key", job(metadata={"k\x00": "v"}), 400, "metadata", "a key must not"),
    ("NUL in a metadata value", job(metadata={"k": "v\x00"}), 400, "metadata.k", "NUL"),
    ("NUL in stop", params(stop="\x00"), 400, "items[0].params.stop", "NUL"),
    ("NUL in a stop list", params(stop=["a", "b\x00"]), 400, "items[0].params.stop[1]", "NUL"),
    ("NUL in model", job(model="m\x00"), 400, "model", "NUL"),
    ("NUL in an unknown key", job(**{"k\x00": 1}), 400, None, "a key must not"),
    ("NUL in after (items)", ("GET", "/v1/jobs/{job}/items?after=a%00"), 400, "after", "NUL"),
    ("NUL in after (jobs)", ("GET", "/v1/jobs?after=a%00"), 400, "after", "NUL"),
    # --- 5. surrogates and bad UTF-8 ----------------------------------------------------------
    ("lone high surrogate escape", raw_prompt(rb"\ud800"), 400, None, "lone UTF-16 surrogate"),
    ("lone low surrogate escape", raw_prompt(rb"\udfff"), 400, None, "lone UTF-16 surrogate"),
    ("reversed surrogate pair", raw_prompt(rb"\udc00\ud800"), 400, None, "lone UTF-16"),
    ("high surrogate then a letter", raw_prompt(rb"\ud800\u0041"), 400, None, "lone UTF-16"),
    ("high surrogate twice", raw_prompt(rb"\ud800\ud800"), 400, None, "lone UTF-16"),
    (
        "lone surrogate in custom_id",
        b'{"items":[{"custom_id":"\\uD800","prompt":"x"}]}',
        400,
        None,
        "at byte 25",
    ),
    (
        "lone surrogate in a metadata key",
        b'{"metadata":{"\\ud800":"v"},' + GOOD[1:] + b"}",
        400,
        None,
        "lone UTF-16",
    ),
    ("CESU-8 bytes (encoded surrogate)", raw_prompt(b"\xed\xa0\x80"), 400, None, "invalid UTF-8"),
    ("CESU-8 pair", raw_prompt(b"\xed\xa0\xbd\xed\xb8\x80"), 400, None, "invalid UTF-8"),
    ("byte 0xFF", raw_prompt(b"\xff"), 400, None, "invalid UTF-8 at byte 38"),
    ("overlong encoding", raw_prompt(b"\xc0\xaf"), 400, None, "invalid UTF-8"),
    (
        "truncated character at the end",
        b'{"items":[{"prompt":"x\xe2\x82',
        400,
        None,
        "invalid UTF-8 at byte 23",
    ),
    # Its bytes are checked before the parser sees them, however the body is cut into chunks.
    ("truncated character after the object", GOOD + b"}\xe2\x82", 400, None, "invalid UTF-8"),
    ("Latin-1 body", raw_prompt("café".encode("latin-1")), 400, None, "invalid UTF-8"),
    # --- 6. trailing data, duplicate keys -----------------------------------------------------
    ("trailing garbage", GOOD + b"} garbage", 400, None, "trailing garbage"),
    ("a second object", GOOD + b'}{"items":[{"prompt":"y"}]}', 400, None, "trailing garbage"),
    ("a trailing bracket", GOOD + b"}]", 400, None, "trailing garbage"),
    ("a trailing comma", GOOD + b"},", 400, None, "trailing garbage"),
    ("duplicate items", GOOD + b',"items":[{"prompt":"y"}]}', 400, "items", "duplicate key"),
    (
        "duplicate key in an item",
        b'{"items":[{"prompt":"x","prompt":"y"}]}',
        400,
        "items[0].prompt",
        "duplicate key",
    ),
    (
        "duplicate key in metadata",
        GOOD + b',"metadata":{"a":"1","a":"2"}}',
        400,
        "metadata.a",
        "duplicate key",
    ),
    (
        "duplicate key in params",
        b'{"items":[{"prompt":"x","params":{"seed":1,"seed":2}}]}',
        400,
        "items[0].params.seed",
        "duplicate key",
    ),
    (
        "duplicate key in a message",
        b'{"items":[{"messages":[{"role":"user","role":"system","content":"x"}]}]}',
        400,
        "items[0].messages[0].role",
        "duplicate key",
    ),
    # --- 9. messages: numbers, invalid JSON, 413 ----------------------------------------------
    (
        "max_tokens 2^63",
        b'{"items":[{"prompt":"x","params":{"max_tokens":9223372036854775808}}]}',
        400,
        "items[0].params.max_tokens",
        "from 1 to 32768",
    ),
    (
        "seed 2^64",
        b'{"params":{"seed":18446744073709551616},' + GOOD[1:] + b"}",
        400,
        "params.seed",
        "<= 9223372036854775807",
    ),
    (
        "priority 2^63",
        GOOD + b',"priority":9223372036854775808}',
        400,
        "priority",
        "from 0 to 9",
    ),
    (
        "top_k below -2^63",
        b'{"params":{"top_k":-9223372036854775809},' + GOOD[1:] + b"}",
        400,
        "params.top_k",
        ">= -1",
    ),
    (
        "temperature 1e999",
        b'{"params":{"temperature":1e999},' + GOOD[1:] + b"}",
        400,
        "params.temperature",
        "<= 2",
    ),
    (
        # Read as the nearest double, 0: checked as 0, where 0 is not allowed.
        "top_p 1e-400",
        b'{"params":{"top_p":1e-400},' + GOOD[1:] + b"}",
        400,
        "params.top_p",
        "greater than 0",
    ),
    (
        "completion_window 1e400",
        GOOD + b',"completion_window":1e400}',
        400,
        "completion_window",
        "from 1 to",
    ),
    (
        "big number in an unknown field",
        GOOD + b',"x":123456789012345678901234567890}',
        400,
        "x",
        "out of range",
    ),
    ("not JSON", b"{items: [", 400, None, "not valid JSON: invalid char in json text (at byte 2)"),
    ("empty body", b"", 400, None, "empty"),
    ("whitespace only", b"  \n ", 400, None, "ends at byte 4"),
    ("truncated", GOOD, 400, None, "ends at byte"),
    ("NaN", GOOD + b',"priority":NaN}', 400, None, "not valid JSON"),
    (
        "Infinity",
        b'{"params":{"temperature":Infinity},' + GOOD[1:] + b"}",
        400,
        None,
        "not valid JSON",
    ),
    ("single quotes", b"{'items': []}", 400, None, "not valid JSON"),
    ("a comma too many", b'{"items":[{"prompt":"x"},]}', 400, None, "not valid JSON"),
    ("bad escape", raw_prompt(rb"\q"), 400, None, "not valid JSON"),
    ("short \\u escape", raw_prompt(rb"\u12"), 400, None, "not valid JSON"),
    ("byte order mark", b"\xef\xbb\xbf" + GOOD + b"}", 400, None, "not valid JSON"),
    (
        "error after 100 KB",
        b'{"items":[' + b'{"prompt":"x"},' * 8000 + b'{"prompt":x}]}',
        400,
        None,
        "at byte 120021",
    ),
    ("a JSON array", b"[1, 2]", 400, None, "should be an object"),
    ("a JSON string", b'"items"', 400, None, "should be an object"),
    ("null", b"null", 400, None, "should be an object"),
    ("items not an array", {"items": {"a": ITEM}}, 400, "items", "valid array"),
    ("items a string", {"items": SECRET}, 400, "items", "valid array"),
    (
        "body over the size limit",
        {"items": [{"prompt": "x" * (MAX_BYTES + 1)}]},
        413,
        None,
        f"limit of {MAX_BYTES} bytes",
    ),
    # --- 10. prompt size --------------------------------------------------------------------
    (
        "prompt over MAX_PROMPT_CHARS",
        item(prompt="x" * 1_000_001),
        400,
        "items[0].prompt",
        "limit of 1000000",
    ),
    (
        "messages over MAX_PROMPT_CHARS",
        {"items": [{"messages": [{"role": "user", "content": "x" * 600_000}] * 2}]},
        400,
        "items[0].messages",
        "limit of 1000000",
    ),
    (
        "a late item over MAX_PROMPT_CHARS",
        b'{"items":[{"prompt":"a"},{"prompt":"' + "é".encode() * 1_000_001 + b'"}]}',
        400,
        "items[1].prompt",
        "limit",
    ),
    # --- 11. what one item may cost ----------------------------------------------------------
    (
        "1,025 messages (MAX_MESSAGES_PER_ITEM)",
        {"items": [{"messages": [{"role": "user", "content": "x"}] * 1025}]},
        400,
        "items[0].messages",
        "more than 1024 messages",
    ),
    (
        "100,000 one-character messages: refused at the 1,025th",
        b'{"items":[{"messages":['
        + b",".join([b'{"role":"user","content":"x"}'] * 100_000)
        + b"]}]}",
        400,
        "items[0].messages",
        "more than 1024 messages",
    ),
    (
        "an item of 100,001 values (MAX_ITEM_VALUES)",
        {"items": [{"prompt": "x", "params": {"stop": [0] * 100_001}}]},
        400,
        "items[0]",
        "more than 100000 JSON values",
    ),
    (
        "an item of 2,000,001 characters (MAX_ITEM_CHARS)",
        {"items": [{"prompt": "x", "zz": "y" * 2_000_001}]},
        400,
        "items[0]",
        "more than 2000000 characters",
    ),
    (
        "the job's params of 100,001 values",
        {"params": {"stop": [0] * 100_001}, "items": [ITEM]},
        400,
        "params",
        "more than 100000 JSON values",
    ),
    (
        "a 5,000-digit integer",
        b'{"items":[{"prompt":"x","params":{"seed":' + b"9" * 5000 + b"}}]}",
        400,
        "items[0].params.seed",
        "out of range",
    ),
    (
        "a 5,000-digit integer in metadata",
        b'{"metadata":{"a":' + b"1" * 5000 + b'},"items":[{"prompt":"x"}]}',
        400,
        "metadata.a",
        "out of range",
    ),
    # --- shapes (kept from before, for the table) ------------------------------------------------
    ("missing items", {"params": {}}, 400, "items", "Field required"),
    ("empty items", {"items": []}, 400, "items", "at least 1 item"),
    (
        "both messages and prompt",
        {"items": [{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}]},
        400,
        "items[0]",
        "exactly one",
    ),
    (
        "unknown role",
        {"items": [{"messages": [{"role": "robot", "content": "x"}]}]},
        400,
        "items[0].messages[0].role",
        "'system', 'user', 'assistant' or 'tool'",
    ),
    ("duplicate custom_id", {"items": [ITEM, ITEM]}, 400, "items[1].custom_id", "duplicate"),
    ("unknown top-level field", job(colour="red"), 400, "colour", "Extra inputs"),
    ("unknown model", job(model="gpt-9"), 400, "model", "unknown model"),
    ("metadata value not a string", job(metadata={"a": 1}), 400, "metadata.a", "valid string"),
    (
        "metadata key too long",
        job(metadata={"k" * 100: "v"}),
        400,
        "metadata." + "k" * 64,
        "at most 64",
    ),
    ("priority 12", job(priority=12), 400, "priority", "less than or equal to 9"),
]


@pytest.fixture(scope="module")
def table() -> Iterator[list[str]]:
    rows: list[str] = []
    yield rows
    out = os.environ.get("HOSTILE_CASES_TABLE")
    if out:
        header = "| # | case | status | param | message |\n|---|---|---|---|---|\n"
        with open(out, "w") as f:
            f.write(header + "\n".join(rows) + "\n")


@pytest.fixture
def hostile_app(make_app: Callable[..., Flask]) -> Flask:
    return make_app(max_request_bytes=MAX_BYTES)


def _send(client: FlaskClient, request: Any, job_id: str) -> Any:
    if isinstance(request, tuple):
        return client.get(request[1].format(job=job_id))
    data = request if isinstance(request, bytes) else json.dumps(request).encode()
    return client.post("/v1/jobs", data=data, content_type="application/json")


def _counts(db: sa.Engine) -> tuple[int, int]:
    with db.connect() as conn:
        jobs = conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar()
        items = conn.execute(sa.text("SELECT count(*) FROM items")).scalar()
    return jobs or 0, items or 0


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 60
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("name", "request_", "status", "param", "words"), CASES, ids=[c[0] for c in CASES]
)
def test_hostile_request(
    hostile_app: Flask,
    db: sa.Engine,
    caplog: pytest.LogCaptureFixture,
    table: list[str],
    name: str,
    request_: Any,
    status: int,
    param: str | None,
    words: str,
) -> None:
    client = keyed_client(hostile_app, make_key(db, TENANT))
    created = client.post("/v1/jobs", json={"items": [{"prompt": "fine"}]})
    assert created.status_code == 201
    before = _counts(db)
    caplog.set_level(logging.DEBUG)

    response = _send(client, request_, created.json["id"])

    error = (response.json or {}).get("error", {})
    message = error.get("message", "")
    if error.get("param") and message.startswith(error["param"] + ": "):
        message = message[len(error["param"]) + 2 :]  # the param column names it
    table.append(
        f"| {len(table) + 1} | {name} | {response.status_code} | "
        f"{'`' + error.get('param') + '`' if error.get('param') else ''} | "
        f"{message[:120].replace('|', '/')} |"
    )
    assert response.status_code == status, error
    assert set(error) == {"type", "code", "message", "param"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"], error["message"]
    assert "\n" not in error["message"] and "(right here)" not in error["message"]
    assert SECRET not in error["message"]  # no echo of the body
    assert len(error["message"]) < 400
    assert _counts(db) == before
    assert SECRET not in caplog.text


# --- 1. nesting: bounded time and memory ----------------------------------------------------

_DEEP_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    import psutil
    import sqlalchemy as sa
    from tests.helpers import TENANT, keyed_client, make_key, make_settings
    from api import create_app

    app = create_app(make_settings(sys.argv[1], sys.argv[2]))
    client = keyed_client(app, make_key(sa.create_engine(sys.argv[1]), TENANT))
    def post(depth):
        body = b'{"metadata":{"a":' + b"[" * depth + b"]" * depth + b'},"items":[{"prompt":"x"}]}'
        return client.post("/v1/jobs", data=body, content_type="application/json")
    post(40)  # warm up: imports, the connection pool, the code paths
    me = psutil.Process()
    rss, peak = me.memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Today's parser takes gigabytes for this body: fail with MemoryError, not the machine.
    limit = me.memory_info().vms + 1024**3
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start = time.monotonic()
    response = post(int(sys.argv[3]))
    seconds = time.monotonic() - start
    print(json.dumps({
        "status": response.status_code,
        "param": (response.json or {}).get("error", {}).get("param"),
        "seconds": seconds,
        "rss_growth": me.memory_info().rss - rss,
        "peak_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) * 1024,
    }))
    """
)


def test_100000_levels_of_nesting_are_refused_in_bounded_time_and_memory(
    settings: Settings, db: sa.Engine
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _DEEP_CHILD,
            settings.require_database_url(),
            settings.require_redis_url(),
            "100000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["status"] == 400, outcome
    assert outcome["param"].startswith("metadata.a[0]")
    assert outcome["seconds"] < 1.0, outcome
    assert outcome["rss_growth"] < 50 * 1024**2, outcome
    assert outcome["peak_growth"] < 50 * 1024**2, outcome
    assert _counts(db) == (0, 0)


# --- the byte checks do not depend on how the body is cut into chunks -----------------------


class _Trickle(io.RawIOBase):
    """A stream that returns at most `step` bytes a read, as a slow client's socket does."""

    def __init__(self, data: bytes, step: int):
        self.data, self.step, self.pos = data, step, 0

    def read(self, size: int = -1) -> bytes:
        n = self.step if size < 0 else min(size, self.step)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk


def _outcome(body: bytes, step: int) -> tuple[str, Any]:
    try:
        return "ok", list(guard.read_body(_Trickle(body, step), guard.Limits(max_depth=32)))  # type: ignore[arg-type]
    except InputError as error:
        return "error", (error.message, error.param)


@pytest.mark.parametrize(
    "body",
    [
        raw_prompt(rb"\ud83d\ude00 and \\ud800 and \\\ud83d\ude00"),
        raw_prompt(rb"\\\ud800"),
        raw_prompt(rb"\ud83d\u0041"),
        raw_prompt(rb"\udfff"),
        raw_prompt("é€😀".encode() + b"\xed\xa0\x80"),
        raw_prompt("é€😀".encode()) + b" x",
        raw_prompt(rb"\u00e9\\u\\\\"),
        b'\xed\xa0\x80{"items":[]}',  # a character cut by a chunk: held until it is whole
        b'{"items":[]}\xe2\x82',
        b'{"items":[{"prompt":"' + b"\\\\" * 20 + rb'\ud800"}]}',
    ],
)
def test_checks_agree_for_any_chunking(body: bytes) -> None:
    expected = _outcome(body, 65536)
    for step in (1, 2, 3, 5, 7, 11, 13):
        assert _outcome(body, step) == expected, step


def test_valid_escapes_pass_unchanged() -> None:
    body = raw_prompt(rb"\ud83d\ude00\\ud800\n\u00e9")
    kind, events = _outcome(body, 3)
    assert kind == "ok"
    assert events[-1] == ("item", {"prompt": SECRET + "😀\\ud800\né"})


# --- 11. a 500: a request id in the answer and the log line, no request data in the log ------


def test_a_500_has_a_request_id_and_logs_no_prompt(
    client: FlaskClient, db: sa.Engine, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    from thinkbatch.jobs import create as job_create

    row = job_create.ItemRows.row

    def broken_row(self: Any, index: int, item: Any) -> tuple[object, ...]:
        values = list(row(self, index, item))
        values[3] = "{not json " + SECRET  # a COPY error whose text quotes the row
        return tuple(values)

    monkeypatch.setattr(job_create.ItemRows, "row", broken_row)
    caplog.set_level(logging.DEBUG)
    body = {"items": [{"messages": [{"role": "user", "content": SECRET}]}]}
    response = client.post("/v1/jobs", json=body, headers={"X-Request-ID": "req-42.a:b"})

    assert response.status_code == 500
    assert response.headers["X-Request-ID"] == "req-42.a:b"
    assert "req-42.a:b" in response.json["error"]["message"]
    assert "req-42.a:b" in caplog.text
    assert "InvalidTextRepresentation" in caplog.text  # the log still says what failed
    assert SECRET not in caplog.text
    assert _counts(db) == (0, 0)


@pytest.mark.parametrize("incoming", ["", "a b", "x" * 129, "é"])
def test_an_unusable_request_id_is_replaced(client: FlaskClient, incoming: str) -> None:
    response = client.get("/v1/jobs", headers={"X-Request-ID": incoming})
    rid = response.headers["X-Request-ID"]
    assert rid != incoming and len(rid) == 32


def test_every_answer_has_a_request_id(client: FlaskClient, db: sa.Engine) -> None:
    first = client.get("/v1/jobs").headers["X-Request-ID"]
    second = client.post("/v1/jobs", data=b"{").headers["X-Request-ID"]
    assert first and second and first != second
