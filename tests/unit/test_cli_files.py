"""How the CLI reads a JSONL file of items into a job body: blank lines are JSON's whitespace
only, so a line the API would refuse reaches it, named by its place, instead of being dropped."""

from __future__ import annotations

from pathlib import Path

from thinkbatch.cli.main import _native_body


def test_only_lines_of_json_whitespace_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_bytes(b'{"prompt":"a"}\r\n \t\n\x0c\n{"prompt":"b"}\n\n')
    assert b"".join(_native_body(path)) == b'{"items":[{"prompt":"a"},\x0c,{"prompt":"b"}]}'
