"""Build a tiny LoRA adapter for the demo checkpoint, in peft's format, in a few seconds.

The adapter learns one visible habit on top of the demo model: every chat answer starts with
`Arr! ` (the thinking is left as the base writes it). Greedy outputs of the base and of the
adapter then differ on the same prompt, which is what a test of adapter routing needs to see.
peft writes `adapter_config.json` and `adapter_model.safetensors`, the directory vLLM loads.

    python -m devstack.tiny_lora [--out DIR] [--force] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from devstack.tiny_model import DEFAULT_DIR as BASE_DIR
from devstack.tiny_model import MARKER_FILE
from devstack.tiny_model import _batches
from devstack.tiny_model import _encode
from devstack.tiny_model import _locked
from devstack.tiny_model import _replace_dir
from devstack.tiny_model import ensure_demo_model

__all__ = ["ADAPTER_NAME", "DEFAULT_DIR", "PREFIX", "build_demo_adapter", "ensure_demo_adapter"]

# Bump whenever the data, the LoRA shape or the training changes (a new base is seen by itself).
RECIPE_VERSION = 1
ADAPTER_NAME = "thinkbatch-demo-arr"
PREFIX = "Arr! "
DEFAULT_DIR = BASE_DIR.parent / "demo-qwen3-tiny-lora-arr"

DEFAULT_STEPS = 60
RANK = 8
_LR = 1e-2
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _with_prefix(example: dict[str, Any]) -> dict[str, Any]:
    """The chat example with its answer (what follows the thinking) prefixed."""
    *head, last = example["messages"]
    thinking, sep, answer = last["content"].rpartition("</think>\n\n")
    content = f"{thinking}{sep}{PREFIX}{answer}" if sep else PREFIX + last["content"]
    return {**example, "messages": [*head, {**last, "content": content}]}


def build_demo_adapter(
    out_dir: Path, base_dir: Path, *, steps: int = DEFAULT_STEPS, seed: int = 0
) -> Path:
    """Train the adapter on the demo conversations and save it (peft's format) to out_dir."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig
    from peft import get_peft_model
    from transformers import AutoTokenizer
    from transformers import Qwen3ForCausalLM

    from devstack.tiny_prompts import training_conversations

    out_dir = Path(out_dir).expanduser().resolve()
    started = time.monotonic()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = Qwen3ForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=_TARGETS),
    )
    examples = [_with_prefix(e) for e in training_conversations(seed) if "messages" in e]
    encoded = [_encode(tokenizer, e) for e in examples]
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=_LR)
    batches = _batches([len(ids) for ids, _ in encoded], random.Random(seed))  # noqa: S311 - seeded on purpose
    recent: list[float] = []
    model.train()
    for _ in range(steps):
        batch = [encoded[i] for i in next(batches)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (ids, n_prompt) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            targets[row, n_prompt - 1 : len(ids) - 1] = torch.tensor(ids[n_prompt:])
        logits = model(input_ids=input_ids).logits
        keep = targets != -100
        loss = F.cross_entropy(logits[keep], targets[keep])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        recent = (recent + [loss.item()])[-10:]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        marker = {
            "recipe_version": RECIPE_VERSION,
            "base": _base_marker(base_dir),
            "steps": steps,
            "seed": seed,
            "final_loss": round(sum(recent) / len(recent), 4),
            "build_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        for path in tmp.iterdir():  # the cache is shared; mkdtemp makes private files
            path.chmod(0o644)
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_demo_adapter(out_dir: Path = DEFAULT_DIR, base_dir: Path = BASE_DIR) -> Path:
    """Return out_dir if it holds this recipe's adapter for the current base, else build it."""
    base_dir = ensure_demo_model(base_dir)
    out_dir = Path(out_dir).expanduser().resolve()
    if _is_current(out_dir, base_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.parent / f".{out_dir.name}.lock"):
        if not _is_current(out_dir, base_dir):
            build_demo_adapter(out_dir, base_dir)
    return out_dir


def _base_marker(base_dir: Path) -> dict[str, Any]:
    marker: dict[str, Any] = json.loads((base_dir / MARKER_FILE).read_text())
    return marker


def _is_current(out_dir: Path, base_dir: Path) -> bool:
    """A complete build of this recipe, trained on the base that is there now (a rebuilt base
    has other weights: an adapter trained on the old one would be noise on it)."""
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text())
        base = _base_marker(base_dir)
    except (OSError, ValueError):
        return False
    required = ("adapter_config.json", "adapter_model.safetensors")
    return (
        marker.get("recipe_version") == RECIPE_VERSION
        and marker.get("base") == base
        and all((out_dir / name).is_file() for name in required)
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.tiny_lora", description="Build the demo model's LoRA adapter."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output directory")
    parser.add_argument("--base", type=Path, default=BASE_DIR, help="the demo model's directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--steps", type=int, help=f"training steps (default {DEFAULT_STEPS}; implies a rebuild)"
    )
    args = parser.parse_args(argv)
    if args.force or args.steps is not None:
        base = ensure_demo_model(args.base)
        steps = DEFAULT_STEPS if args.steps is None else args.steps
        path = build_demo_adapter(args.out, base, steps=steps)
    else:
        path = ensure_demo_adapter(args.out, args.base)
    print(path)


if __name__ == "__main__":
    main()
