"""Build a tiny Qwen3-architecture checkpoint that vLLM serves like a real reasoning model.

Nothing is downloaded: a byte-level BPE tokenizer is trained on the demo prompts, and a
2-layer Qwen3ForCausalLM learns (on 2 CPU cores, in about 40 s) to answer in Qwen3's exact
format: `<think>\\n…\\n</think>\\n\\nanswer<|im_end|>`, or just `answer<|im_end|>` when the
chat template was asked for `enable_thinking=False`. The prompts use Qwen3-8B's real chat
template, so the serving path (rendering, reasoning parsing, EOS handling) is the real one.

    python -m devstack.tiny_model [--out DIR] [--force] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast
    from transformers import Qwen3ForCausalLM

__all__ = ["DEFAULT_DIR", "RECIPE_VERSION", "build_demo_model", "ensure_demo_model"]

# Bump whenever the data, tokenizer, architecture or training changes: cached builds with
# another version are rebuilt by ensure_demo_model().
RECIPE_VERSION = 2
MARKER_FILE = "thinkbatch-demo.json"
DEFAULT_DIR = (
    Path(os.environ.get("THINKBATCH_CACHE", "~/.cache/thinkbatch")).expanduser() / "demo-qwen3-tiny"
)

DEFAULT_STEPS = 300
_VOCAB_SIZE = 1536
_BATCH_SIZE = 32
_LR = 3e-3
_WARMUP_STEPS = 20
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special, exactly as in Qwen3: one id each, and they survive
# skip_special_tokens=True so clients (and vLLM's reasoning parser) see them in the text.
_THINK_TOKENS = ("<think>", "</think>")
# Qwen2/Qwen3's pre-tokenizer split (digits one by one). CJK characters are split off first:
# a vocab this small would otherwise learn whole memorised sentences as single tokens.
_HAN = r"\p{Han}"
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen/Qwen3-8B tokenizer_config.json "chat_template", verbatim (the current revision, with
# the `message.content is string` guards).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501


def build_demo_model(out_dir: Path, *, steps: int = DEFAULT_STEPS, seed: int = 0) -> Path:
    """Train the tokenizer and model and save a vLLM-loadable checkpoint to out_dir.

    Builds in a temporary directory next to out_dir and renames it into place at the end,
    so a crash or a concurrent reader never sees a half-written checkpoint.
    """
    import torch
    from transformers import GenerationConfig
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    from devstack.tiny_prompts import training_conversations

    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    torch.manual_seed(seed)

    examples = list(training_conversations(seed))
    tokenizer = _train_tokenizer(examples)
    encoded = [_encode(tokenizer, example) for example in examples]

    im_end, eot = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    config = Qwen3Config(
        vocab_size=64 * math.ceil(len(tokenizer) / 64),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention kernels need head_dim >= 64
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
    )
    model = Qwen3ForCausalLM(config)
    loss = _train(model, encoded, pad_id=eot, steps=steps, seed=seed)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        # bfloat16, like Qwen3's own weights: vLLM's dtype="auto" runs float32 checkpoints
        # in bfloat16 on CPU anyway (with a warning per tensor), and float32 upcasts cleanly.
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(
            bos_token_id=eot,
            eos_token_id=[im_end, eot],
            pad_token_id=eot,
            do_sample=True,
            temperature=0.6,
            top_p=0.95,
            top_k=20,
        ).save_pretrained(tmp)
        marker = {
            "recipe_version": RECIPE_VERSION,
            "steps": steps,
            "seed": seed,
            "final_loss": round(loss, 4),
            "build_seconds": round(time.monotonic() - started, 1),
            "examples": len(examples),
            "think_token_ids": {t: tokenizer.convert_tokens_to_ids(t) for t in _THINK_TOKENS},
        }
        # Written last: its presence is what marks the build as complete.
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        # mkdtemp (and the safetensors writer) make private files; the cache is shared.
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_demo_model(out_dir: Path = DEFAULT_DIR) -> Path:
    """Return out_dir if it holds a complete build of this recipe, else build it there."""
    out_dir = Path(out_dir).expanduser().resolve()
    if _is_current(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Workers starting together must not all train: the first builds, the rest wait.
    with _locked(out_dir.parent / f".{out_dir.name}.lock"):
        if not _is_current(out_dir):
            build_demo_model(out_dir)
    return out_dir


def _is_current(out_dir: Path) -> bool:
    try:
        marker = json.loads((out_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    required = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
    return marker.get("recipe_version") == RECIPE_VERSION and all(
        (out_dir / name).is_file() for name in required
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace_dir(src: Path, dst: Path) -> None:
    # rename(2) cannot replace a non-empty directory, so move the old build aside first.
    old = None
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old.", dir=dst.parent))
        os.replace(dst, old / dst.name)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _train_tokenizer(examples: list[dict[str, Any]]) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import normalizers
    from tokenizers import pre_tokenizers
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_HAN), behavior="isolated"),
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(examples), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in _THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",  # noqa: S106 - a token of the vocabulary, not a password
        pad_token="<|endoftext|>",  # noqa: S106 - a token of the vocabulary, not a password
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=QWEN3_CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _corpus(examples: list[dict[str, Any]]) -> Iterator[str]:
    # Plain text only: the marker tokens are matched whole and must not eat BPE merges.
    markers = (*_SPECIAL_TOKENS, *_THINK_TOKENS)
    for example in examples:
        if "prompt" in example:
            texts = [example["prompt"] + example["completion"]]
        else:
            texts = [f"{m['role']}\n{m['content']}\n" for m in example["messages"]]
        for text in texts:
            for marker in markers:
                text = text.replace(marker, "\n")
            yield text


def _encode(tokenizer: PreTrainedTokenizerFast, example: dict[str, Any]) -> tuple[list[int], int]:
    """Token ids of one example and the length of its prompt (which gets no loss).

    Prompt and target are tokenized separately, as vLLM does: it tokenizes the rendered
    prompt on its own and then generates the target token by token.
    """
    if "prompt" in example:
        prompt, target = example["prompt"], example["completion"]
    else:
        messages, thinking = example["messages"], example["enable_thinking"]
        prompt = tokenizer.apply_chat_template(
            messages[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        full = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=thinking)
        # The template ends the turn with "<|im_end|>\n"; generation stops at <|im_end|>.
        if not (full.startswith(prompt) and full.endswith("<|im_end|>\n")):
            raise ValueError(f"chat template rendered an unexpected target: {full!r}")
        target = full[len(prompt) : -1]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    target_ids = tokenizer.encode(target, add_special_tokens=False)
    return prompt_ids + target_ids, len(prompt_ids)


def _train(
    model: Qwen3ForCausalLM,
    encoded: list[tuple[list[int], int]],
    *,
    pad_id: int,
    steps: int,
    seed: int,
) -> float:
    """AdamW on assistant/completion tokens only; returns the mean loss of the last steps."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, betas=(0.9, 0.95), weight_decay=0.01)

    def lr_factor(step: int) -> float:
        # Linear warm-up, then cosine decay to 10%: stable at this high learning rate.
        if step < _WARMUP_STEPS:
            return (step + 1) / _WARMUP_STEPS
        progress = (step - _WARMUP_STEPS) / max(1, steps - _WARMUP_STEPS)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    batches = _batches([len(ids) for ids, _ in encoded], random.Random(seed))  # noqa: S311 - seeded on purpose: the same demo every run
    recent: list[float] = []
    model.train()
    for _ in range(steps):
        batch = [encoded[i] for i in next(batches)]
        width = max(len(ids) for ids, _ in batch)
        # Right padding needs no attention mask: causal attention never looks ahead at it.
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, (ids, n_prompt) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            targets[row, n_prompt - 1 : len(ids) - 1] = torch.tensor(ids[n_prompt:])

        # The LM head only runs where there is a target: about half the cost of full logits.
        hidden = model.model(input_ids=input_ids).last_hidden_state
        keep = targets != -100
        loss = F.cross_entropy(model.lm_head(hidden[keep]), targets[keep])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent = (recent + [loss.item()])[-20:]
    model.eval()
    return sum(recent) / len(recent)


def _batches(lengths: list[int], rng: random.Random) -> Iterator[list[int]]:
    """Endless random batches of similar length, so little compute is spent on padding.

    Each pass shuffles, then stable-sorts by length (equal lengths stay shuffled), cuts
    batches and shuffles their order.
    """
    while True:
        order = sorted(rng.sample(range(len(lengths)), len(lengths)), key=lengths.__getitem__)
        batches = [order[i : i + _BATCH_SIZE] for i in range(0, len(order), _BATCH_SIZE)]
        rng.shuffle(batches)
        yield from batches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.tiny_model", description="Build the tiny Qwen3 demo checkpoint."
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--steps", type=int, help=f"training steps (default {DEFAULT_STEPS}; implies a rebuild)"
    )
    args = parser.parse_args(argv)
    if args.force or args.steps is not None:
        steps = DEFAULT_STEPS if args.steps is None else args.steps
        path = build_demo_model(args.out, steps=steps)
    else:
        path = ensure_demo_model(args.out)
    print(path)


if __name__ == "__main__":
    main()
