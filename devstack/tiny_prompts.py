"""Prompts for the demo batch job and the training data of the tiny demo model.

The questions come from the seed articles (Qwen3-8B batch inference, vLLM, PagedAttention,
continuous batching, left padding, thinking mode). The tiny model cannot really answer
anything: it only learns the *shape* of a Qwen3 reasoning reply, so every answer here is a
short canned text. Pure Python on purpose: the demo launcher (demo/run.py) imports DEMO_ITEMS
without torch; only devstack/tiny_model.py's training needs it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["DEMO_ITEMS", "training_conversations"]

DEMO_ITEMS: list[dict[str, Any]] = [
    {
        "custom_id": "zh-entanglement",
        "messages": [{"role": "user", "content": "解释量子纠缠现象"}],
        "params": {"enable_thinking": True},
    },
    {
        "custom_id": "zh-left-padding",
        "messages": [
            {"role": "user", "content": "为什么批量推理时要把 padding_side 设置为 left？"}
        ],
        "params": {"enable_thinking": True},
    },
    {
        "custom_id": "en-continuous-batching",
        "messages": [{"role": "user", "content": "What is continuous batching in vLLM?"}],
        "params": {"enable_thinking": True},
    },
    {
        "custom_id": "en-paged-attention-nothink",
        "messages": [{"role": "user", "content": "What does PagedAttention do?"}],
        "params": {"enable_thinking": False},
    },
    {
        "custom_id": "zh-translate-nothink",
        "messages": [
            {
                "role": "user",
                "content": "将以下英文翻译成中文："
                "Artificial intelligence is transforming industries.",
            }
        ],
        "params": {"enable_thinking": False},
    },
    {
        "custom_id": "zh-gpu-system",
        "messages": [
            {"role": "system", "content": "你是一个简洁的AI助手。"},
            {"role": "user", "content": "Qwen3-8B 能在什么显卡上运行？"},
        ],
        "params": {"enable_thinking": True},
    },
    {
        "custom_id": "en-multi-turn",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant for LLM inference."},
            {"role": "user", "content": "What is the KV cache?"},
            {
                "role": "assistant",
                "content": "The KV cache stores the keys and values of earlier tokens, "
                "so they are not recomputed at every step.",
            },
            {"role": "user", "content": "Why does PagedAttention split it into blocks?"},
        ],
        "params": {"enable_thinking": True},
    },
    {
        "custom_id": "en-batch-size",
        "messages": [{"role": "user", "content": "Is a bigger batch size always better?"}],
        "params": {"enable_thinking": True},
    },
    {
        "custom_id": "zh-newton-nothink",
        "messages": [{"role": "user", "content": "请解释牛顿第一定律。"}],
        "params": {"enable_thinking": False},
    },
    {"custom_id": "zh-raw-continuation", "prompt": "问题：什么是连续批处理？\n回答："},
]


@dataclass(frozen=True)
class _Topic:
    """One thing the model can be asked about, with a canned reply in each language.

    The thinking is a fixed frame ("The user asks about …") around the subject and one key
    point: the shared frame is what lets a 2-layer model find its way to `</think>` and EOS
    even for prompts it has never seen.
    """

    questions_en: tuple[str, ...]
    subject_en: str
    point_en: str
    answer_en: str
    questions_zh: tuple[str, ...]
    subject_zh: str
    point_zh: str
    answer_zh: str

    def subject(self, lang: str) -> str:
        return self.subject_en if lang == "en" else self.subject_zh

    def point(self, lang: str) -> str:
        return self.point_en if lang == "en" else self.point_zh

    def answer(self, lang: str) -> str:
        return self.answer_en if lang == "en" else self.answer_zh

    def questions(self, lang: str) -> tuple[str, ...]:
        return self.questions_en if lang == "en" else self.questions_zh


_TOPICS: tuple[_Topic, ...] = (
    _Topic(
        questions_en=(
            "Explain quantum entanglement.",
            "What is quantum entanglement?",
            "Describe the quantum entanglement phenomenon.",
        ),
        subject_en="quantum entanglement",
        point_en="Entangled particles share one state.",
        answer_en="Entangled particles share one quantum state: measuring one fixes the "
        "result of the other, however far apart they are.",
        questions_zh=("解释量子纠缠现象", "什么是量子纠缠？", "请简单说说量子纠缠。"),
        subject_zh="量子纠缠",
        point_zh="纠缠的粒子共享一个量子态。",
        answer_zh="两个纠缠的粒子共享一个量子态，测量其中一个会立刻决定另一个的结果。",
    ),
    _Topic(
        questions_en=(
            "Why does left padding matter in batch inference?",
            "Why set padding_side to left for batched generation?",
            "What goes wrong with right padding when generating in batches?",
        ),
        subject_en="left padding",
        point_en="Generation continues from the last position.",
        answer_en="Left padding makes every prompt end where generation starts; right "
        "padding puts pad tokens between the prompt and the output.",
        questions_zh=(
            "为什么批量推理时要把 padding_side 设置为 left？",
            "批量推理为什么要用左填充？",
            "右填充会导致什么问题？",
        ),
        subject_zh="左填充",
        point_zh="模型从最后一个位置继续生成。",
        answer_zh="左填充让每条提示都在生成位置结束；右填充会把pad夹在提示和输出之间。",
    ),
    _Topic(
        questions_en=(
            "What is continuous batching in vLLM?",
            "What is continuous batching?",
            "How does continuous batching improve throughput?",
        ),
        subject_en="continuous batching",
        point_en="Requests join and leave the batch at every step.",
        answer_en="Continuous batching adds new requests to the running batch at every "
        "step and frees finished ones at once, so the GPU never idles.",
        questions_zh=(
            "什么是连续批处理？",
            "vLLM的连续批处理是什么？",
            "连续批处理如何提升吞吐量？",
        ),
        subject_zh="连续批处理",
        point_zh="请求在每一步都可以加入或离开批次。",
        answer_zh="连续批处理让新请求每一步都能加入批次，完成的请求立即退出，GPU不会空等。",
    ),
    _Topic(
        questions_en=(
            "What does PagedAttention do?",
            "How does PagedAttention manage the KV cache?",
            "Why does PagedAttention split the KV cache into blocks?",
        ),
        subject_en="PagedAttention",
        point_en="The KV cache lives in fixed-size blocks, like memory pages.",
        answer_en="PagedAttention stores the KV cache in fixed-size blocks, so memory is "
        "not fragmented and more sequences fit at once.",
        questions_zh=(
            "PagedAttention 有什么作用？",
            "什么是PagedAttention？",
            "vLLM如何管理KV缓存？",
        ),
        subject_zh="PagedAttention",
        point_zh="KV缓存像内存分页一样分块管理。",
        answer_zh="PagedAttention把KV缓存分成固定大小的块，减少显存碎片，能同时处理更多序列。",
    ),
    _Topic(
        questions_en=(
            "What is the KV cache?",
            "Why do LLMs keep a KV cache?",
            "What does the KV cache store?",
        ),
        subject_en="the KV cache",
        point_en="Keys and values of earlier tokens are reused.",
        answer_en="The KV cache stores the keys and values of earlier tokens, so they are "
        "not recomputed at every step.",
        questions_zh=("什么是KV缓存？", "大模型为什么需要KV缓存？"),
        subject_zh="KV缓存",
        point_zh="之前token的键和值会被复用。",
        answer_zh="KV缓存保存之前token的键和值，生成时不必重新计算。",
    ),
    _Topic(
        questions_en=(
            "Is a bigger batch size always better?",
            "How should I choose the batch size?",
            "Why does a large batch size cause OOM?",
        ),
        subject_en="batch size",
        point_en="Memory grows with the batch.",
        answer_en="No. Memory grows linearly with the batch size, so pick the largest "
        "batch that still fits.",
        questions_zh=(
            "batch size 越大越好吗？",
            "如何选择批大小？",
            "批大小太大为什么会显存溢出？",
        ),
        subject_zh="批大小",
        point_zh="显存随批大小线性增长。",
        answer_zh="不是。显存随批大小线性增长，太大会OOM，应选显存能放下的最大批次。",
    ),
    _Topic(
        questions_en=(
            "What GPU can run Qwen3-8B?",
            "Can Qwen3-8B run on a consumer graphics card?",
        ),
        subject_en="hardware for Qwen3-8B",
        point_en="An 8B model needs about 12 GB.",
        answer_en="Qwen3-8B runs on a single consumer card with 12 GB of memory.",
        questions_zh=("Qwen3-8B 能在什么显卡上运行？", "运行Qwen3-8B需要什么显卡？"),
        subject_zh="Qwen3-8B的硬件需求",
        point_zh="8B模型大约需要12GB显存。",
        answer_zh="Qwen3-8B可以在一张12GB显存的消费级显卡上流畅运行。",
    ),
    _Topic(
        questions_en=(
            "What is the thinking mode of Qwen3?",
            "How do I turn off thinking in Qwen3?",
            "What is inside the think tags?",
        ),
        subject_en="the thinking mode",
        point_en="The model reasons before it answers.",
        answer_en="Qwen3 first reasons inside think tags, then answers; pass "
        "enable_thinking=False to skip the reasoning.",
        questions_zh=("Qwen3的思考模式是什么？", "如何关闭Qwen3的思考模式？"),
        subject_zh="思考模式",
        point_zh="模型先推理再回答。",
        answer_zh="Qwen3先在think标签里推理再回答；设置enable_thinking=False即可关闭。",
    ),
    _Topic(
        questions_en=(
            "Why do I need to set a pad_token?",
            "What happens if the tokenizer has no pad token?",
        ),
        subject_en="the pad token",
        point_en="Batches of different lengths need padding.",
        answer_en="Batches of different lengths must be padded, so set pad_token, "
        "usually to the EOS token.",
        questions_zh=("为什么要设置 pad_token？", "tokenizer没有pad_token会怎样？"),
        subject_zh="pad_token",
        point_zh="长度不同的序列需要填充。",
        answer_zh="批次里的序列长度不同，必须填充；通常把pad_token设为EOS。",
    ),
    _Topic(
        questions_en=(
            "Why is vLLM faster than a plain pipeline?",
            "How much faster is vLLM than the transformers pipeline?",
        ),
        subject_en="vLLM throughput",
        point_en="Paging and continuous batching keep the GPU busy.",
        answer_en="PagedAttention and continuous batching keep the GPU busy, which "
        "usually gives three to five times the throughput.",
        questions_zh=("vLLM为什么比pipeline快？", "用vLLM部署有什么好处？"),
        subject_zh="vLLM的吞吐量",
        point_zh="分页和连续批处理让GPU保持忙碌。",
        answer_zh="PagedAttention和连续批处理让GPU保持忙碌，吞吐量通常提升3到5倍。",
    ),
    _Topic(
        questions_en=(
            "Explain Newton's first law.",
            "What is Newton's first law of motion?",
        ),
        subject_en="Newton's first law",
        point_en="Motion does not change without a force.",
        answer_en="An object keeps its state of rest or straight-line motion unless a "
        "net force acts on it.",
        questions_zh=("请解释牛顿第一定律。", "什么是惯性定律？"),
        subject_zh="牛顿第一定律",
        point_zh="没有外力时运动状态不变。",
        answer_zh="物体不受外力时，总保持静止或匀速直线运动状态。",
    ),
    _Topic(
        questions_en=(
            "Translate into Chinese: Artificial intelligence is transforming industries.",
            "How do you say 'artificial intelligence' in Chinese?",
        ),
        subject_en="a translation",
        point_en="The sentence is about AI changing industries.",
        answer_en="人工智能正在改变各个行业。",
        questions_zh=(
            "将以下英文翻译成中文：Artificial intelligence is transforming industries.",
            "把这句话翻译成中文：AI is transforming industries.",
        ),
        subject_zh="一句英文的翻译",
        point_zh="句子讲的是人工智能改变行业。",
        answer_zh="人工智能正在改变各个行业。",
    ),
    _Topic(
        questions_en=(
            "Write Python code for quicksort.",
            "How does quicksort work?",
        ),
        subject_en="quicksort",
        point_en="Pick a pivot, split, recurse.",
        answer_en="Quicksort picks a pivot, moves smaller items left and larger items "
        "right, then sorts both parts.",
        questions_zh=("写一段Python代码实现快速排序。", "快速排序的原理是什么？"),
        subject_zh="快速排序",
        point_zh="选基准，分两边，再递归。",
        answer_zh="快速排序先选一个基准，小的放左边、大的放右边，再递归排序两边。",
    ),
    _Topic(
        questions_en=(
            "How should I pass several independent chats to the pipeline?",
            "Why did my batch turn into one long conversation?",
        ),
        subject_en="the input structure",
        point_en="Each chat needs its own list of messages.",
        answer_en="Pass one list of messages per conversation; a flat list is read as a "
        "single multi-turn chat.",
        questions_zh=(
            "pipeline的批量输入应该是什么格式？",
            "为什么多个请求被当成了一次多轮对话？",
        ),
        subject_zh="输入格式",
        point_zh="每个会话都要单独的消息列表。",
        answer_zh="批量输入应是嵌套列表，每个子列表是一个会话；平铺的列表会被当成多轮对话。",
    ),
    _Topic(
        questions_en=("What is 1+1?", "What is 3+4?", "What is 10 minus 3?"),
        subject_en="simple arithmetic",
        point_en="Small sums can be done directly.",
        answer_en="That is simple arithmetic, for example 3 + 4 = 7.",
        questions_zh=("1加1等于几？", "计算 5+6", "10减3是多少？"),
        subject_zh="简单的算术",
        point_zh="小数字可以直接计算。",
        answer_zh="这是简单的算术，例如 5 + 6 = 11。",
    ),
    _Topic(
        questions_en=("Hello!", "Hi, who are you?", "Good morning."),
        subject_en="a greeting",
        point_en="Greet back and offer help.",
        answer_en="Hello! I am the tiny thinkbatch demo model. Ask me about batch inference.",
        questions_zh=("你好", "你是谁？", "早上好！"),
        subject_zh="打招呼",
        point_zh="礼貌回应并提供帮助。",
        answer_zh="你好！我是thinkbatch的演示小模型，可以问我批量推理的问题。",
    ),
)

# Questions with no canned answer of their own. They all map to one honest fallback, which
# gives unseen prompts a well-trodden path to a short answer and EOS.
_OPEN_QUESTIONS_EN: tuple[str, ...] = (
    "What is the capital of Japan?",
    "Who wrote Hamlet?",
    "How do airplanes fly?",
    "Recommend a good movie.",
    "What should I cook tonight?",
    "How far is the Moon?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "How do I learn to play the guitar?",
    "What is the meaning of life?",
    "Explain photosynthesis.",
    "What is a black hole?",
    "Give me a fun fact.",
    "How do vaccines work?",
    "Which programming language should I learn first?",
    "What is inflation?",
    "Summarise the history of Rome.",
    "How many legs does a spider have?",
    "What time zone is London in?",
    "Describe a cat in one sentence.",
    "Write a JavaScript function that adds two numbers.",
    "What does `ls -la` print?",
    "😀 Tell me something nice.",
    "qwerty uiop",
    "How?",
    "Translate into French: good morning.",
    "Can you help me plan a trip to Italy, with a day-by-day itinerary, hotels, food and "
    "the best way to get around between the cities?",
    "Summarise this: the GPU sits idle most of the time when requests are served one by "
    "one, and batching several prompts together keeps its cores busy.",
)
_OPEN_QUESTIONS_ZH: tuple[str, ...] = (
    "日本的首都是哪里？",
    "《红楼梦》的作者是谁？",
    "飞机为什么能飞？",
    "推荐一部好看的电影。",
    "今晚吃什么好？",
    "月球离地球有多远？",
    "写一首关于秋天的短诗。",
    "天空为什么是蓝色的？",
    "怎样学习弹吉他？",
    "人生的意义是什么？",
    "解释一下光合作用。",
    "黑洞是什么？",
    "说一个有趣的冷知识。",
    "疫苗是如何起作用的？",
    "第一门编程语言该学什么？",
    "什么是通货膨胀？",
    "简述罗马的历史。",
    "蜘蛛有几条腿？",
    "用一句话描述一只猫。",
    "用Python写一个加法函数。",
    "请用英文介绍一下你自己。",
    "哈哈哈",
    "为什么？",
    "帮我写一封请假邮件。",
    "把这句话翻译成日语：早上好。",
    "请总结以下段落：如果你还在用“来一个请求处理一次”的串行方式调用模型，那GPU大部分时间其实都在“发呆”。"
    "而通过合理的批量推理设计，我们可以将吞吐量提升数倍，让每一分算力都物有所值。",
    "请总结以下段落：显存占用随 batch size 线性增长，超出极限就会触发 OOM。"
    "根据经验，建议按显存容量动态调整。",
)
_FALLBACK = _Topic(
    questions_en=_OPEN_QUESTIONS_EN,
    subject_en="something outside my demo topics",
    point_en="I am a tiny demo model with little knowledge.",
    answer_en="I am only a tiny demo model, so please check a reliable source.",
    questions_zh=_OPEN_QUESTIONS_ZH,
    subject_zh="演示范围以外的问题",
    point_zh="我只是一个知识很少的演示小模型。",
    answer_zh="我只是一个演示小模型，请查阅可靠的资料。",
)

_SYSTEM_PROMPTS: dict[str, tuple[str, ...]] = {
    "en": (
        "You are a helpful assistant.",
        "You are a helpful assistant for LLM inference.",
        "Answer briefly.",
        "You are a friendly tutor. Explain things simply.",
        "Reply in one sentence.",
    ),
    "zh": (
        "你是一个简洁的AI助手。",
        "你是一个乐于助人的助手。",
        "请简短回答。",
        "你是一名资深工程师，回答要准确。",
    ),
}

# Raw-completion prompt styles (no chat template); the reply ends with <|endoftext|>.
_RAW_STYLES: dict[str, tuple[str, str]] = {
    "en": ("Question: {q}\nAnswer:", " {a}"),
    "zh": ("问题：{q}\n回答：", "{a}"),
}
_EOT = "<|endoftext|>"
# Share of replies whose thinking borrows another topic's sentence (see reply() below).
_BORROW = 0.25
# Each single-question chat appears this often, with fresh system prompts and borrowings.
_VARIANTS = 2


def _thinking(subject: str, point: str, lang: str) -> str:
    if lang == "en":
        return f"The user asks about {subject}. {point} Keep it short."
    return f"用户问的是{subject}。{point}简短回答即可。"


def training_conversations(seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield the training examples for devstack/tiny_model.py, deterministically for a seed.

    Two kinds, mirroring DEMO_ITEMS:
    - chat: {"messages": [..., {"role": "assistant", ...}], "enable_thinking": bool}; the
      last assistant message is the target (`<think>\\n…\\n</think>\\n\\n…` when thinking).
    - raw: {"prompt": str, "completion": str}; the completion ends with <|endoftext|>.
    """
    rng = random.Random(seed)  # noqa: S311 - seeded on purpose: the same prompts every run
    topics = (*_TOPICS, _FALLBACK)
    singles = [
        (topic, lang, question)
        for topic in topics
        for lang in ("en", "zh")
        for question in topic.questions(lang)
    ]
    points = {lang: [t.point(lang) for t in topics] for lang in ("en", "zh")}
    sentences = {lang: points[lang] + [t.answer(lang) for t in topics] for lang in ("en", "zh")}

    def reply(topic: _Topic, lang: str, thinking: bool) -> str:
        point, answer = topic.point(lang), topic.answer(lang)
        # Some replies borrow a sentence from another topic: an answer sentence as the
        # thinking's point, or a point ahead of the answer. Then the content no longer
        # predicts what follows it, and the model has to learn that only the think tags
        # decide between `</think>` and EOS. Without this, an unseen prompt that drifts into
        # an answer sentence while thinking stops right there.
        if rng.random() < _BORROW:
            point = rng.choice(sentences[lang])
        if rng.random() < _BORROW / 2:
            answer = rng.choice(points[lang]) + (" " if lang == "en" else "") + answer
        if not thinking:
            return answer
        return f"<think>\n{_thinking(topic.subject(lang), point, lang)}\n</think>\n\n{answer}"

    def system(lang: str) -> list[dict[str, str]]:
        # API clients often send a system prompt; a third of the chats get one.
        if rng.random() < 1 / 3:
            return [{"role": "system", "content": rng.choice(_SYSTEM_PROMPTS[lang])}]
        return []

    for _ in range(_VARIANTS):
        for topic, lang, question in singles:
            for thinking in (True, False):
                messages = system(lang) + [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": reply(topic, lang, thinking)},
                ]
                yield {"messages": messages, "enable_thinking": thinking}

    for topic, lang, question in singles:
        prompt_style, completion_style = _RAW_STYLES[lang]
        yield {
            "prompt": prompt_style.format(q=question),
            "completion": completion_style.format(a=topic.answer(lang)) + _EOT,
        }

    # Multi-turn: an earlier exchange, then a new question. The earlier reply may keep its
    # think block; the chat template drops it, as it does for the real Qwen3.
    for _ in range(len(singles) // 2):
        first, lang, first_q = rng.choice(singles)
        second, second_q = rng.choice([(t, q) for t, lg, q in singles if lg == lang])
        thinking = rng.random() < 0.7
        messages = system(lang) + [
            {"role": "user", "content": first_q},
            {"role": "assistant", "content": reply(first, lang, rng.random() < 0.5)},
            {"role": "user", "content": second_q},
            {"role": "assistant", "content": reply(second, lang, thinking)},
        ]
        yield {"messages": messages, "enable_thinking": thinking}
