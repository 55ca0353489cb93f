"""An item's prefix key: the order in which workers claim a job's items (CLAIM_ORDER=prefix).

vLLM's prefix cache keeps the KV of a prompt's leading blocks while they fit, so items that
share a long beginning (a few-shot system prompt, a document asked several questions) run
cheaper when they run close together: the shared part is computed once and read from the
cache after. A batch file seldom lists them together. Claiming in this key's order does.

The key hashes the text an item's prompt starts from (its model, its tools, then its messages
or prompt, as stored) at every power-of-two length from LEVEL_MIN bytes up that the text
outlasts: one 4-byte CRC per level, each continuing the one before. Ordered as bytes, the keys
put together the items that share their first LEVEL_MIN bytes, within those the ones that
share twice as many, and so on: items whose texts share a beginning of S bytes are next to
each other, among the items that share their largest power-of-two part of it (more than
S / 2), whatever S is. Ties keep submission order, so a job whose items share nothing the
prefix cache could keep (texts of at most LEVEL_MIN bytes, which have an empty key) runs in
the order it came. CRC-32 is no defence against a chosen collision; none is needed: a
collision puts two unrelated items side by side, which costs a cache hit, nothing else.
"""

from __future__ import annotations

import zlib

# The first level: about 32 tokens, two of vLLM's 16-token blocks on a GPU. What two items
# share below it saves too little to order by.
LEVEL_MIN = 128
# The last level: past it, the items that share this much stay together in submission order.
LEVEL_MAX = 1 << 20


def prefix_key(model: str | None, tools: bytes | None, text: bytes) -> bytes:
    """The claim key of an item run on `model` (None: its job's) with `tools` (the tools' JSON
    as stored) and `text` (its messages' JSON or its prompt, UTF-8)."""
    name = (model or "").encode()
    size = len(name) + len(tools or b"") + len(text) + 2
    if size <= LEVEL_MIN:  # the common short item: no level, no copy
        return b""
    data = b"%s\x00%s\x00%s" % (name, tools or b"", text)
    key = bytearray()
    crc = 0
    start = 0
    level = LEVEL_MIN
    # A level the text ends at or before is left out: what follows it is what the item
    # shares with no one, and hashing it would only scatter items that share nothing.
    while level < size and level <= LEVEL_MAX:
        crc = zlib.crc32(data[start:level], crc)
        key += crc.to_bytes(4, "big")
        start = level
        level *= 2
    return bytes(key)
