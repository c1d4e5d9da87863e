"""Thinking kept out of the answer (localllm/reasoning.py): the parsers split any chunking of a reply the
same way, and the engine, driving tiny models whose replies are scripted token by token, puts the
reasoning in `reasoning` and never a think tag in `text`, whether the reply ends, is cut by
max_tokens, or has its reasoning budget spent (the end marker is then forced)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_think import reply_ids, script_replies, write_harmony_model, write_think_model

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.reasoning import (
    HARMONY,
    THINK,
    ReasoningSpec,
    detect_reasoning,
)
from localllm.sampling_params import SamplingParams
from localllm.tokenizer.chat_template import ChatTemplate, apply_chat_template

THINK_SPEC = ReasoningSpec(THINK)
HARMONY_SPEC = ReasoningSpec(HARMONY, "<|channel|>", "<|end|>")
TAGS = ("<think>", "</think>")


def split(spec: ReasoningSpec, chunks: list[str], prime: str = "") -> tuple[str, str]:
    parser = spec.parser()
    parser.prime(prime)
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# ------------------------------------------------------------------------------------------ parsers


@pytest.mark.parametrize(
    "text,prime,expected",
    [
        ("<think>\nLet me see.\n</think>\n\nHello!", "assistant\n", ("Let me see.", "Hello!")),
        ("Let me see.\n</think>\n\nHello!", "assistant\n<think>\n", ("Let me see.", "Hello!")),
        ("Hello!", "assistant\n<think>\n\n</think>\n\n", ("", "Hello!")),
        ("Still thinking </thi", "assistant\n<think>\n", ("Still thinking </thi", "")),
        ("Hi </think> there", "assistant\n", ("", "Hi there")),  # a stray end tag is dropped
        ("<think>a</think>b<think>c</think>d", "", ("a\n\nc", "bd")),
    ],
)
def test_think_parser(text: str, prime: str, expected: tuple[str, str]) -> None:
    assert split(THINK_SPEC, [text], prime) == expected


H = "<|start|>assistant"
CALL = '<tool_call>\n{{"name": {}, "arguments": {}}}\n</tool_call>'
HARMONY_CASES = [
    (
        f"<|channel|>analysis<|message|>User greets.<|end|>{H}<|channel|>final<|message|>Hi there",
        ("User greets.", "Hi there"),
    ),
    (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        f'{H}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{"city":"Oslo"}}',
        (
            "Need the weather.",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>',
        ),
    ),
    (
        " to=functions.now<|channel|>commentary json<|message|>",
        ("", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
    ),
    ("Plain words", ("", "Plain words")),
    ("<|channel|>analysis<|message|>cut short", ("cut short", "")),
    ("<|channel|>analy", ("", "")),  # a header cut short is markup, not text
    (
        "<|channel|>analysis<|message|>a<|end|>"
        f"{H}<|channel|>analysis<|message|>b<|end|>{H}<|channel|>final<|message|>c",
        ("a\n\nb", "c"),
    ),
]


@pytest.mark.parametrize("text,expected", HARMONY_CASES)
def test_harmony_parser(text: str, expected: tuple[str, str]) -> None:
    assert split(HARMONY_SPEC, [text], "assistant") == expected


def test_any_chunking_splits_alike() -> None:
    """A tag split across tokens, anywhere: every chunking gives the one-piece split."""
    rng = random.Random(0)
    texts = [(THINK_SPEC, "<think>\n a  b \n</think>\n\nAns </think> x <think> y </think>z", "assistant\n")]
    texts += [(HARMONY_SPEC, text, "assistant") for text, _ in HARMONY_CASES]
    for spec, text, prime in texts:
        whole = split(spec, [text], prime)
        for _ in range(300):
            assert split(spec, random_chunks(rng, text), prime) == whole


def test_format_from_the_template() -> None:
    assert detect_reasoning("{{ '<think>\\n' }}...</think>") == THINK_SPEC
    assert detect_reasoning("{{ m.content }}") is None
    assert detect_reasoning("[THINK]x[/THINK]").start == "[THINK]"
    harmony = detect_reasoning("<|channel|>analysis<|message|>", {"<|channel|>": 1, "<|message|>": 2})
    assert harmony is not None and harmony.format == HARMONY
    assert detect_reasoning("<|channel|>analysis<|message|>", {}) is None  # not without the tokens


# ------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def think_engine(tmp_path_factory: pytest.TempPathFactory, index_dir: Path) -> LLMEngine:
    path = write_think_model(tmp_path_factory.mktemp("think") / "think.gguf")
    return LLMEngine(EngineConfig(model=str(path), backend="numpy", index_dir=index_dir, threads=1))


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory: pytest.TempPathFactory, index_dir: Path) -> LLMEngine:
    path = write_harmony_model(tmp_path_factory.mktemp("harmony") / "harmony.gguf")
    return LLMEngine(EngineConfig(model=str(path), backend="numpy", index_dir=index_dir, threads=1))


def chat_ids(engine: LLMEngine, text: str = "Hi", **kwargs: object) -> list[int]:
    template = ChatTemplate.from_metadata(engine.gguf.metadata)
    assert template is not None
    return apply_chat_template(engine.tokenizer, template, [{"role": "user", "content": text}], **kwargs)


def params(spec: ReasoningSpec | None, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 200), reasoning=spec, **kw)  # type: ignore[arg-type]


def test_think_reply_split_by_the_engine(think_engine: LLMEngine) -> None:
    ids = reply_ids(think_engine, "<think>\nLet me see.\n</think>\n\nHello!")
    script_replies(think_engine, lambda seq: ids)
    [out] = think_engine.generate([chat_ids(think_engine)], params(THINK_SPEC))
    assert (out.reasoning, out.text, out.finish_reason) == ("Let me see.", "Hello!", "stop")
    assert out.reasoning_tokens == len(reply_ids(think_engine, "\nLet me see.\n"))
    [raw] = think_engine.generate([chat_ids(think_engine)], params(None))  # no spec: the text as written
    assert raw.text == "<think>\nLet me see.\n</think>\n\nHello!" and raw.reasoning == ""


def test_streamed_and_unstreamed_alike(think_engine: LLMEngine) -> None:
    ids = reply_ids(think_engine, "<think>\nStep one. Step two.\n</think>\n\nThe answer.")
    script_replies(think_engine, lambda seq: ids)
    [whole] = think_engine.generate([chat_ids(think_engine)], params(THINK_SPEC))
    outs = list(think_engine.stream(chat_ids(think_engine), params(THINK_SPEC)))
    assert "".join(o.reasoning for o in outs) == whole.reasoning == "Step one. Step two."
    assert "".join(o.text for o in outs) == whole.text == "The answer."
    assert sum(bool(o.reasoning) for o in outs) > 1  # it did stream piece by piece


def random_reply(rng: random.Random) -> str:
    words = " ".join(
        rng.choice(["so", "then", "maybe", "<", "/", "think", ">"]) for _ in range(rng.randint(1, 8))
    )
    answer = " ".join(rng.choice(["Yes", "no", "42", "ok"]) for _ in range(rng.randint(1, 4)))
    return f"<think>{rng.choice(['', chr(10), '  '])}{words}{rng.choice(['', chr(10)])}</think>\n\n{answer}"


def test_replies_cut_by_max_tokens_never_leak_tags(think_engine: LLMEngine) -> None:
    """100 replies, each cut at another token (inside the tags too): no tag ever reaches the text, and
    a reply cut inside its thinking is all reasoning."""
    rng = random.Random(1)
    scripts = {seed: reply_ids(think_engine, random_reply(rng)) for seed in range(100)}
    script_replies(think_engine, lambda seq: scripts[seq.params.seed])
    close = think_engine.tokenizer.special_tokens["</think>"]
    cuts = {seed: rng.randint(1, len(ids)) for seed, ids in scripts.items()}
    prompts = [chat_ids(think_engine) for _ in scripts]
    outs = think_engine.generate(prompts, [params(THINK_SPEC, seed=s, max_tokens=cuts[s]) for s in scripts])
    for seed, out in zip(scripts, outs, strict=True):
        assert not any(tag in out.text for tag in TAGS), out.text
        if close not in scripts[seed][: cuts[seed]]:
            assert out.text == "" and out.finish_reason == "length"
        assert out.token_ids == scripts[seed][: cuts[seed]]


def thinking_forever(engine: LLMEngine, answer: str):  # noqa: ANN201
    """A script that thinks until `</think>` is in the reply (forced), then writes `answer`."""
    close = engine.tokenizer.special_tokens["</think>"]
    thought = reply_ids(engine, "<think>\n" + "I wonder, " * 60)
    tail = reply_ids(engine, "\n\n" + answer)

    def script(seq):  # noqa: ANN001, ANN202
        out = seq.output_token_ids
        return out[: out.index(close) + 1] + tail if close in out else thought

    return script


def test_budget_closes_thinking_with_the_models_end_tag(think_engine: LLMEngine) -> None:
    """100 replies with budgets 0..99: each stops thinking after at most its budget of reasoning tokens,
    `</think>` forced, and the answer that follows is the content, with no tag in it."""
    script_replies(think_engine, thinking_forever(think_engine, "Done."))
    budgets = list(range(100))
    prompts = [chat_ids(think_engine) for _ in budgets]
    outs = think_engine.generate(prompts, [params(THINK_SPEC.with_budget(b)) for b in budgets])
    close = think_engine.tokenizer.special_tokens["</think>"]
    for budget, out in zip(budgets, outs, strict=True):
        assert out.text == "Done." and out.finish_reason == "stop"
        assert out.reasoning_tokens == budget
        assert out.token_ids.count(close) == 1 and out.token_ids.index(close) == budget + 1
        assert not any(tag in out.text or tag in out.reasoning for tag in TAGS)


def test_budget_zero_when_the_prompt_opens_thinking(tmp_path: Path, index_dir: Path) -> None:
    path = write_think_model(tmp_path / "open.gguf", open_think=True)
    engine = LLMEngine(EngineConfig(model=str(path), backend="numpy", index_dir=index_dir, threads=1))
    ids = reply_ids(engine, "Hmm.\n</think>\n\nOk.")
    script_replies(engine, lambda seq: ids)
    [out] = engine.generate([chat_ids(engine)], params(THINK_SPEC))
    assert (out.reasoning, out.text) == ("Hmm.", "Ok.")
    script_replies(engine, thinking_forever(engine, "Ok."))
    [out] = engine.generate([chat_ids(engine)], params(THINK_SPEC.with_budget(0)))
    assert (out.reasoning, out.text, out.reasoning_tokens) == ("", "Ok.", 0)
    # enable_thinking=false: the template writes an empty block, so the reply starts as content
    script_replies(engine, lambda seq: reply_ids(engine, "Ok."))
    [out] = engine.generate([chat_ids(engine, enable_thinking=False)], params(THINK_SPEC))
    assert (out.reasoning, out.text) == ("", "Ok.")


def test_harmony_reply_through_the_engine(harmony_engine: LLMEngine) -> None:
    text = (
        "<|channel|>analysis<|message|>They greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello"
    )
    ids = reply_ids(harmony_engine, text)
    script_replies(harmony_engine, lambda seq: ids)
    [out] = harmony_engine.generate([chat_ids(harmony_engine)], params(HARMONY_SPEC))
    assert (out.reasoning, out.text, out.finish_reason) == ("They greet.", "Hello", "stop")


def test_harmony_budget_forces_the_final_channel(harmony_engine: LLMEngine) -> None:
    tok = harmony_engine.tokenizer
    thought = reply_ids(harmony_engine, "<|channel|>analysis<|message|>" + "hmm " * 80)
    final = tok.special_tokens["<|message|>"]

    def script(seq):  # noqa: ANN001, ANN202
        out = seq.output_token_ids
        if out.count(final) < 2:
            return thought
        # after the forced `...<|channel|>final<|message|>` (the second <|message|>): the answer
        at = len(out) - 1 - out[::-1].index(final)
        return out[: at + 1] + reply_ids(harmony_engine, "Fine.")

    script_replies(harmony_engine, script)
    [out] = harmony_engine.generate([chat_ids(harmony_engine)], params(HARMONY_SPEC.with_budget(5)))
    assert out.reasoning_tokens == 5 and ("hmm " * 80).startswith(out.reasoning) and out.reasoning
    assert (out.text, out.finish_reason) == ("Fine.", "stop")


def test_harmony_replies_cut_anywhere_keep_markup_out(harmony_engine: LLMEngine) -> None:
    """A harmony reply cut after each of its tokens: no marker in the reasoning or the answer, and the
    answer is a beginning of the final channel's text."""
    text = f"<|channel|>analysis<|message|>Think a bit.<|end|>{H}<|channel|>final<|message|>The final answer."
    ids = reply_ids(harmony_engine, text)
    script_replies(harmony_engine, lambda seq: ids)
    cuts = list(range(1, len(ids) + 1))
    prompts = [chat_ids(harmony_engine) for _ in cuts]
    outs = harmony_engine.generate(prompts, [params(HARMONY_SPEC, max_tokens=n) for n in cuts])
    for out in outs:
        assert "<|" not in out.text and "<|" not in out.reasoning
        assert "The final answer.".startswith(out.text) and "Think a bit.".startswith(out.reasoning)
    assert (outs[-1].reasoning, outs[-1].text) == ("Think a bit.", "The final answer.")
