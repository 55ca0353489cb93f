"""A deterministic stand-in engine: no torch, instant start, and faults on demand.

It batches like vLLM: up to MAX_NUM_SEQS sequences advance one token per step (`step_s`), new
requests join between steps, and a request returns when its last token is produced. Tokens are
UTF-8 bytes plus Qwen's special tokens, rendered with a Qwen3-style chat template.

Markers in an item's text inject faults, for the reliability tests:
`[[poison]]` kills the engine (like vLLM's EngineDeadError), `[[exit]]` kills the worker
process, `[[fail]]` makes this one request fail, `[[hang]]` never finishes.
Faults while preparing: `[[fail-render]]`, `[[fail-tokenize]]` and `[[fail-params]]` raise from
`prepare` at that stage, for the whole batch it was called with (as a batched tokenizer call
does); `[[fail-submit]]` has the request refused as it is submitted. Sampling values vLLM's
SamplingParams refuses (temperature outside [0, 2], an empty stop string) raise too.
A `thinking_budget` is honoured as vLLM's is: the thinking is cut and `</think>` forced.
Stop strings end the answer as the vLLM adapter ends it, never the thinking.
The request vocabulary is served as vLLM serves it, in shape: `n` choices (each answer marked
with its index), logprobs of every token, a JSON answer that fits the item's schema (built from
it, not sampled), tool calls in Qwen3's format when a prompt says `[[tool]]` (and always with
tool_choice `required` or a named function). `[[bad-json]]` writes a JSON-constrained answer
that is not JSON (a grammar cut short); `[[grammar-error]]` has the engine refuse the item's
constraint, as xgrammar refuses a schema it cannot compile. A logit_bias outside the
vocabulary is refused, as vLLM refuses it.
LoRA adapters (LORA_ADAPTERS) are served by name, their directories unread: an item naming one
gets the base's plain answer prefixed with `[name] `, so a test sees which one it ran on.
Options come from ENGINE_EXTRA_ARGS: `step_s` (default 0.001) and `tokenize_s_per_mchar`
(seconds of tokenizing per million characters, default 0), which makes a long prompt's
tokenizing take time as a real tokenizer's does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from thinkbatch.ledger import Claimed
from thinkbatch.sampling import Sampling
from thinkbatch.settings import Settings
from thinkbatch.thinking import prompt_opens_thinking
from worker.answer_stops import AnswerStops
from worker.engine import EngineDead
from worker.engine import Generation
from worker.engine import ItemRejected
from worker.engine import ModelShape
from worker.engine import Prepared
from worker.engine import SchedulerLoad
from worker.engine import ThinkTokens
from worker.engine import message_tokens_min
from worker.engine import token_logprob

SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2, "<think>": 3, "</think>": 4, "<|endoftext|>": 5}
_NAMES = {v: k for k, v in SPECIAL.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL) + ")")
_HIDDEN = {1, 2, 5}  # special tokens that detokenization drops, as vLLM does
EOS = SPECIAL["<|im_end|>"]
OFFSET = 10
VOCAB_SIZE = OFFSET + 256


def encode(text: str) -> list[int]:
    ids: list[int] = []
    for part in _SPLIT.split(text):
        if part in SPECIAL:
            ids.append(SPECIAL[part])
        elif part:
            ids += [b + OFFSET for b in part.encode()]
    return ids


def decode(ids: Sequence[int]) -> str:
    if ids and min(ids) >= OFFSET:  # bytes only, no special token: the common case, in one go
        return bytes([token - OFFSET for token in ids]).decode(errors="replace")
    out = bytearray()
    for token in ids:
        if token >= OFFSET:
            out.append(token - OFFSET)
        elif token not in _HIDDEN:
            out.extend(_NAMES[token].encode())
    return out.decode(errors="replace")


def _cut_at_stop(
    prepared: Prepared, ids: list[int]
) -> tuple[list[int], str, str, str | None] | None:
    """The tokens and text of a choice cut at the first stop string of its answer, found token
    by token as vLLM's adapter finds it (worker/answer_stops.py); None if none is there."""
    s = prepared.sampling
    stops = AnswerStops(
        s.stop, opened_in_prompt=prepared.opened_in_prompt, keep=s.include_stop_str_in_output
    )
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if text.endswith("\ufffd"):  # inside a character: the detokenizer holds it back
            continue
        cut = stops.feed(text)
        if cut is not None:
            return ids[:k], "stop", text[: cut.text_end], cut.stop
    return None


def render_chat(
    messages: list[dict[str, Any]], enable_thinking: bool, tools: list[dict[str, Any]] | None = None
) -> str:
    text = ""
    if tools:
        text += f"<|im_start|>system\n<tools>{json.dumps(tools)}</tools><|im_end|>\n"
    text += "".join(
        f"<|im_start|>{m['role']}\n{m.get('content') or ''}"
        + "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in m.get("tool_calls") or ())
        + "<|im_end|>\n"
        for m in messages
    )
    text += "<|im_start|>assistant\n"
    if not enable_thinking:
        text += "<think>\n\n</think>\n\n"
    return text


def _logprob(token: int, top: int) -> dict[str, Any]:
    """A fixed log probability per token, in OpenAI's shape, with `top` alternatives. A byte
    token inside a multi-byte character is that one byte, as a real byte-level vocabulary's."""
    raw = bytes([token - OFFSET]) if token >= OFFSET else b"" if token in _HIDDEN else (
        _NAMES[token].encode())  # fmt: skip
    entry = token_logprob(raw, -0.25)
    return {**entry, "top_logprobs": [entry] * top}


def example(schema: dict[str, Any] | None) -> Any:
    """A value that fits a JSON schema (the common keywords): what a grammar would let through."""
    if not schema:
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example(schema[key][0])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: example(sub) for name, sub in props.items()}
    if kind == "array":
        return [example(schema.get("items"))] * max(1, int(schema.get("minItems", 1)))
    if kind == "string":
        return "x" * max(1, int(schema.get("minLength", 1)))
    if kind == "integer":
        return int(schema.get("minimum", 0))
    if kind == "number":
        return float(schema.get("minimum", 0))
    if kind == "boolean":
        return True
    return None


@dataclass(slots=True)
class _Seq:
    remaining: float
    future: asyncio.Future[None]


class FakeEngine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.step_s = float(settings.engine_extra_args.get("step_s", 0.001))
        self.tokenize_s_per_mchar = float(
            settings.engine_extra_args.get("tokenize_s_per_mchar", 0.0)
        )
        self.max_model_len = settings.max_model_len or 4096
        self.think = ThinkTokens(SPECIAL["<think>"], SPECIAL["</think>"], SPECIAL["<|im_start|>"])
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._step_count = 0  # steps run, and the sequences each ran summed (scheduler_load)
        self._step_requests = 0
        self._dead = False
        self._loop_task: asyncio.Task[None] | None = None
        # Set when a request arrives: an idle engine waits on it instead of stepping. At
        # `step_s: 0` an idle engine that kept stepping would spin on the worker's event loop
        # and take the GIL from the threads that feed it (vLLM's engine runs in its own process).
        self._work = asyncio.Event()

    async def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._steps())

    def shape(self) -> ModelShape:
        # A byte a token, but for the special tokens, each one id for its whole name.
        return ModelShape(
            max_model_len=self.max_model_len,
            token_bytes_max=max(1, *(len(name.encode()) for name in SPECIAL)),
            message_tokens_min=message_tokens_min(
                lambda messages: len(encode(render_chat(messages, True)))
            ),
        )

    def prepare(
        self, items: Sequence[Claimed], sampling: Sequence[Sampling]
    ) -> list[Prepared | ItemRejected]:
        out: list[Prepared | ItemRejected] = []
        for item, params in zip(items, sampling, strict=True):
            if item.messages is not None:
                text = render_chat(item.messages, params.enable_thinking, params.tools)
            else:
                text = item.prompt or ""
            if "[[fail-render]]" in text:
                raise RuntimeError("injected failure while rendering")
            if self.tokenize_s_per_mchar:
                time.sleep(len(text) * self.tokenize_s_per_mchar / 1e6)  # releases the GIL too
            if "[[fail-tokenize]]" in text:
                raise RuntimeError("injected failure while tokenizing")
            ids = encode(text)
            if len(ids) >= self.max_model_len:
                out.append(
                    ItemRejected(
                        "prompt_too_long",
                        f"the prompt is {len(ids)} tokens; the model's context is "
                        f"{self.max_model_len} tokens",
                    )
                )
                continue
            opened = prompt_opens_thinking(
                ids, start_id=3, end_id=4, turn_start_id=SPECIAL["<|im_start|>"]
            )
            self._check_params(params, "[[fail-params]]" in text)
            if "[[grammar-error]]" in text and params.structured is not None:
                out.append(ItemRejected("grammar_error", "injected refusal of the constraint"))
                continue
            adapter = item.model if item.model in self.settings.lora_adapters else None
            out.append(
                Prepared(prompt_ids=ids, opened_in_prompt=opened, sampling=params, adapter=adapter)
            )
        return out

    @staticmethod
    def _check_params(params: Sampling, fail: bool) -> None:
        """Build the engine's parameters: refuse what vLLM's SamplingParams refuses."""
        if fail:
            raise ValueError("injected failure while building the sampling parameters")
        if not 0 <= params.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {params.temperature}.")
        if any(s == "" for s in params.stop):
            raise ValueError("stop cannot contain an empty string.")
        if params.logit_bias and max(params.logit_bias) >= VOCAB_SIZE:
            raise ValueError(f"token_id(s) {max(params.logit_bias)} in logit_bias out of vocab")

    def _answer(self, prepared: Prepared, prompt: str, snippet: str, index: int) -> str:
        s = prepared.sampling
        mark = f" #{index}" if s.n > 1 else ""
        structured = s.structured
        if s.tool_mode == "named" and structured is not None:
            return json.dumps(example(structured.schema or {}))
        if s.tool_mode == "required" and s.tools:
            fn = s.tools[0]["function"]
            return json.dumps([{"name": fn["name"], "parameters": example(fn.get("parameters"))}])
        if s.tool_mode == "auto" and s.tools and "[[tool]]" in prompt:
            fn = s.tools[0]["function"]
            call = {"name": fn["name"], "arguments": example(fn.get("parameters"))}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        if structured is not None and structured.json_answer:
            if "[[bad-json]]" in prompt:
                return '{"cut": '
            return json.dumps(example(structured.schema or {"type": "object"}))
        if structured is not None and structured.kind == "choice":
            return str(structured.spec[0]) if isinstance(structured.spec, list) else ""
        tag = f"[{prepared.adapter}] " if prepared.adapter else ""
        return f"{tag}Answer: {snippet[::-1]}{mark}"

    def _output(
        self, prepared: Prepared, prompt: str, index: int = 0
    ) -> tuple[list[int], str, str, str | None]:
        """(token ids, finish reason, text, stop string that ended it) of one choice."""
        ids, finish = self._generated(prepared, prompt, index)
        if prepared.sampling.stop:
            cut = _cut_at_stop(prepared, ids)
            if cut is not None:
                return cut
        return ids, finish, decode(ids), None

    def _generated(self, prepared: Prepared, prompt: str, index: int) -> tuple[list[int], str]:
        question = prompt.rsplit("user\n", 1)[-1].split("\nassistant\n")[0]
        snippet = " ".join(question.split())[:40]
        answer = self._answer(prepared, prompt, snippet, index)
        if prepared.opened_in_prompt:  # a template that opened <think> itself
            text = f"Thinking about {snippet}.\n</think>\n\n{answer}"
        elif prompt.endswith("assistant\n"):  # chat with thinking on
            text = f"<think>\nThinking about {snippet}.\n</think>\n\n{answer}"
        else:  # thinking off (the template closed an empty block) or a raw prompt
            text = answer
        s = prepared.sampling
        ids = self._within_budget(encode(text), s.thinking_budget) + [EOS]
        budget = min(s.max_tokens, self.max_model_len - len(prepared.prompt_ids))
        if s.ignore_eos:
            ids = (ids[:-1] + [OFFSET + ord(".")] * budget)[:budget]
            return ids, "length"
        if len(ids) > budget:
            return ids[:budget], "length"
        return ids, "stop"

    @staticmethod
    def _within_budget(ids: list[int], budget: int | None) -> list[int]:
        """As vLLM's thinking budget does: after `budget` thinking tokens (an opening <think>
        included) force </think>, and the answer follows."""
        end = SPECIAL["</think>"]
        if budget is None or end not in ids or ids.index(end) <= budget:
            return ids
        return ids[:budget] + ids[ids.index(end) :]

    async def generate(self, request_id: str, prepared: Prepared) -> Generation:
        if self._dead:
            raise EngineDead("fake engine is dead")
        prompt = decode(prepared.prompt_ids)
        if "[[exit]]" in prompt:
            os._exit(70)  # a fault that takes the whole worker process down
        if "[[poison]]" in prompt:
            self._die()
            raise EngineDead("fake engine killed by a poison item")
        if "[[fail]]" in prompt:
            raise RuntimeError("injected failure")
        if "[[fail-submit]]" in prompt:
            raise ItemRejected("invalid_request", "injected refusal of the request")
        outputs = [self._output(prepared, prompt, i) for i in range(prepared.sampling.n)]
        longest = max(len(ids) for ids, _, _, _ in outputs)
        steps = float("inf") if "[[hang]]" in prompt else longest
        seq = _Seq(remaining=steps, future=asyncio.get_running_loop().create_future())
        self._waiting.append(seq)
        self._work.set()
        await seq.future
        top = prepared.sampling.logprobs
        choices = [
            Generation(
                token_ids=ids,
                text=text,
                finish_reason=finish,
                prompt_tokens=len(prepared.prompt_ids),
                logprobs=[_logprob(t, top) for t in ids] if top is not None else None,
                stop_reason=stop,
            )
            for ids, finish, text, stop in outputs
        ]
        first = choices[0]
        first.more = choices[1:] or None
        return first

    def _die(self) -> None:
        self._dead = True
        for seq in self._waiting + self._running:
            if not seq.future.done():
                seq.future.set_exception(EngineDead("fake engine is dead"))
        self._waiting.clear()
        self._running.clear()

    async def _steps(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._work.clear()
                await self._work.wait()
            await asyncio.sleep(self.step_s)
            free = self.settings.max_num_seqs - len(self._running)
            if free > 0 and self._waiting:
                self._running.extend(self._waiting[:free])
                del self._waiting[:free]
            # Two ints a scrape may read between the updates: each only grows, which is all a
            # rate over them needs.
            self._step_count += 1
            self._step_requests += len(self._running)
            still: list[_Seq] = []
            for seq in self._running:
                if seq.future.done():  # aborted by the caller
                    continue
                seq.remaining -= 1
                if seq.remaining <= 0:
                    seq.future.set_result(None)
                else:
                    still.append(seq)
            self._running = still

    def scheduler_load(self) -> SchedulerLoad:
        """Its own queue and batch; it has no KV cache, so no usage to report."""
        return SchedulerLoad(
            waiting=len(self._waiting),
            running=len(self._running),
            kv_cache_usage=0.0,
            steps=self._step_count,
            step_requests=self._step_requests,
        )

    def speculative_stats(self) -> None:
        """No speculation here (the vLLM engine reports its figures)."""
        return None

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
