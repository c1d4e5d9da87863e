"""A chat conversation: the messages, the token ids the engine last saw, trimming, save and load.

No terminal code lives here; `repl.py` draws it and the tests drive it with the engine directly.

Keeping the KV cache across turns. The engine's prefix cache reuses every full KV block whose
tokens start the new prompt, so turn N only prefills what is new *if its prompt starts with the very
token ids of turn N-1's prompt and reply*. Re-tokenizing the conversation from text would not
guarantee that (a reply's generated tokens need not be the canonical tokenization of its text), so,
like llama.cpp's chat, the session remembers (rendered text, token ids) checkpoints - after each
prompt, and after each reply whose tokens decode to its text - and builds the next prompt as the
longest checkpoint whose text starts the new rendering, plus the rest of the rendering tokenized.
When nothing matches (a new system prompt, dropped turns, a loaded file) the whole conversation is
tokenized afresh, and the prefix cache still reuses whatever blocks happen to match.

Overflow. Before each reply the prompt plus some room for the reply (`reserve_tokens`) must fit the
context; while it does not, the oldest turn (a user message and the replies after it) is dropped,
never the system prompt and never the message being answered. The caller is told how many turns
went; nothing is cut silently. A message that cannot fit even alone is refused.

Interrupted replies (Ctrl-C) are kept in the conversation, marked `"interrupted": true` in saved
files, so the model sees what it had said and "go on" works; /regen replaces them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.engine.engine import check_context_length
from localllm.engine.output import StepOutput
from localllm.errors import LocalLLMError
from localllm.sampling_params import SamplingParams

ROLES = ("system", "user", "assistant")
FILE_FORMAT = "localllm-chat"
FILE_VERSION = 1
MAX_CHECKPOINTS = 16

StreamFn = Callable[[list[int], SamplingParams], Iterator[StepOutput]]


@dataclass
class Prompt:
    """The token ids to send for one reply, and what had to go to make them fit."""

    ids: list[int]
    text: str  # the rendered conversation the ids stand for
    dropped_turns: int = 0
    dropped_messages: int = 0
    dropped_tokens: int = 0  # how much shorter the prompt got by dropping them
    undo: list[dict[str, Any]] = field(default_factory=list)  # the messages before this prompt was made


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft: float | None = None
    elapsed: float = 0.0
    finish_reason: str | None = None
    context_size: int = 0
    max_tokens: int | None = None  # the reply's limit (None: the context)

    @property
    def interrupted(self) -> bool:
        return self.finish_reason in (None, "abort")

    @property
    def context_used(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (mlx-lm's and llama.cpp's rate)."""
        if self.ttft is None or self.generated_tokens < 2 or self.elapsed <= self.ttft:
            return 0.0
        return (self.generated_tokens - 1) / (self.elapsed - self.ttft)

    @property
    def prefill_tokens_per_s(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.ttft if self.ttft else 0.0


class ChatSession:
    """One conversation with one model. `prepare` a prompt, then consume `respond` to get the reply."""

    def __init__(self, tokenizer: Any, template: Any, max_model_len: int, system: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.max_model_len = max_model_len
        self.messages: list[dict[str, Any]] = []
        self.history: list[TurnStats] = []  # every reply's stats, for /stats
        self.last_prompt: Prompt | None = None
        self.template_kwargs: dict[str, Any] = {}  # more template variables (/think off: enable_thinking)
        self._checkpoints: list[tuple[str, list[int]]] = []
        if system:
            self.set_system(system)

    # ------------------------------------------------------------------ conversation state

    @property
    def system(self) -> str | None:
        if self.messages and self.messages[0]["role"] == "system":
            return self.messages[0]["content"]
        return None

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None or "" removes it); the rest of the conversation stays."""
        if self.system is not None:
            self.messages.pop(0)
        if text:
            self.messages.insert(0, {"role": "system", "content": text})

    def clear(self) -> None:
        """Forget the conversation; the system prompt stays."""
        system = self.system
        self.messages = []
        self.set_system(system)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    @property
    def context_used(self) -> int:
        """Tokens of the conversation as the engine last saw it (last prompt + its reply)."""
        return self.history[-1].context_used if self.history else 0

    # ------------------------------------------------------------------ prompts

    def prepare(self, user_text: str, max_tokens: int | None = None) -> Prompt:
        """Add the user's message and return the prompt that answers it (trimmed to fit).

        Raises ContextLengthExceededError (and leaves the conversation as it was) when the message
        does not fit the context even with every earlier turn dropped.
        """
        undo = _copy(self.messages)
        self.messages.append({"role": "user", "content": user_text})
        return self._fit(undo, max_tokens)

    def prepare_regen(self, max_tokens: int | None = None) -> Prompt:
        """Drop the last reply and return the prompt that answers the last user message again."""
        undo = _copy(self.messages)
        while self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            self.messages = undo
            raise LocalLLMError("there is no reply to regenerate yet.")
        return self._fit(undo, max_tokens)

    def reserve_tokens(self, max_tokens: int | None) -> int:
        """Room kept free for the reply when trimming: max_tokens, at most a quarter of the context."""
        quarter = max(1, self.max_model_len // 4)
        return min(max_tokens, quarter) if max_tokens else quarter

    def _fit(self, undo: list[dict[str, Any]], max_tokens: int | None) -> Prompt:
        try:
            return self._trim(undo, max_tokens)
        except BaseException:  # a template that rejects the conversation, or a message too long
            self.messages = undo
            raise

    def _trim(self, undo: list[dict[str, Any]], max_tokens: int | None) -> Prompt:
        text, ids = self.encode(self.messages)
        first_len = len(ids)
        reserve = self.reserve_tokens(max_tokens)
        turns = messages = 0
        while len(ids) + reserve > self.max_model_len:
            removed = self._drop_oldest_turn()
            if not removed:
                break
            turns, messages = turns + 1, messages + removed
            text, ids = self.encode(self.messages)
        check_context_length(self.max_model_len, len(ids), None, "messages")  # the engine's rule
        prompt = Prompt(ids, text, turns, messages, first_len - len(ids), undo)
        self._remember(text, ids)
        self.last_prompt = prompt
        return prompt

    def _drop_oldest_turn(self) -> int:
        """Remove the first turn after the system prompt; never the last user message. Returns the
        number of messages removed (0 when nothing can go)."""
        start = 1 if self.system is not None else 0
        last_user = max((i for i, m in enumerate(self.messages) if m["role"] == "user"), default=-1)
        if start >= last_user:
            return 0
        end = start + 1
        while end < last_user and self.messages[end]["role"] != "user":
            end += 1
        del self.messages[start:end]
        return end - start

    def encode(self, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        """The rendered prompt for `messages` (ending with the assistant's turn) and its token ids,
        reusing the ids of the longest remembered text that starts it."""
        from localllm.tokenizer.chat_template import apply_chat_template

        plain = [_for_template(m) for m in messages]
        text = self.template.render(plain, add_generation_prompt=True, **self.template_kwargs)
        for known_text, known_ids in sorted(self._checkpoints, key=lambda c: -len(c[0])):
            if text.startswith(known_text):
                rest = self.tokenizer.encode(text[len(known_text) :], add_special=False, parse_special=True)
                # only split where a special token starts (e.g. <|im_end|>): no BPE merge or
                # SentencePiece space prefix can then differ from tokenizing the whole text
                if not rest or self.tokenizer.is_special(rest[0]):
                    return text, known_ids + rest
        return text, apply_chat_template(self.tokenizer, self.template, plain, True, **self.template_kwargs)

    def _remember(self, text: str, ids: list[int]) -> None:
        self._checkpoints = [c for c in self._checkpoints if c[0] != text][-(MAX_CHECKPOINTS - 1) :]
        self._checkpoints.append((text, list(ids)))

    # ------------------------------------------------------------------ replies

    def respond(self, stream: StreamFn, prompt: Prompt, params: SamplingParams) -> Iterator[StepOutput]:
        """Stream the reply to `prompt`; when it ends - finished, interrupted (KeyboardInterrupt, or
        the consumer closing the iterator) - it joins the conversation. An engine error before any
        output puts the conversation back as it was before `prepare`."""
        parts: list[str] = []
        thoughts: list[str] = []
        token_ids: list[int] = []
        last: StepOutput | None = None
        failed = False
        outputs = stream(prompt.ids, params)
        try:
            for out in outputs:
                last = out
                parts.append(out.text)
                thoughts.append(out.reasoning)
                if out.token_id is not None:
                    token_ids.append(out.token_id)
                yield out
        except Exception:
            failed = True
            raise
        finally:
            close = getattr(outputs, "close", None)
            if close is not None:
                close()  # a reply cut short: abort its request now, not when the iterator is collected
            if failed and last is None:
                self.messages = prompt.undo
            else:
                self._record(prompt, "".join(parts), token_ids, last, params.max_tokens, "".join(thoughts))

    def _record(
        self,
        prompt: Prompt,
        text: str,
        token_ids: list[int],
        last: StepOutput | None,
        max_tokens: int | None = None,
        reasoning: str = "",
    ) -> None:
        stats = TurnStats(len(prompt.ids), context_size=self.max_model_len, max_tokens=max_tokens)
        if last is not None:
            stats.cached_tokens = last.cached_tokens
            stats.generated_tokens = last.generated_tokens
            stats.ttft, stats.elapsed = last.ttft, last.elapsed
            stats.finish_reason = last.finish_reason if last.finished else None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:  # kept apart; the template decides whether later prompts show it
            message["reasoning_content"] = reasoning
        if stats.interrupted:
            message["interrupted"] = True
        self.messages.append(message)
        self.history.append(stats)
        body = list(token_ids)
        if last is not None and last.finish_reason == "stop" and isinstance(last.stop_reason, int) and body:
            body.pop()  # the end-of-turn token: the template writes its own
        if body and not reasoning and self.tokenizer.decode(body, skip_special=True) == text:
            self._remember(prompt.text + text, prompt.ids + body)

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        return {"format": FILE_FORMAT, "version": FILE_VERSION, "messages": _copy(self.messages)}

    def save(self, path: str | Path) -> Path:
        path = Path(path).expanduser()
        try:
            path.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise LocalLLMError(f"cannot write {path}: {e.strerror}.") from None
        return path

    def load(self, path: str | Path) -> int:
        """Replace the conversation with the one saved in `path` (ours, or a bare list of OpenAI-style
        messages). A file without a system message keeps the current system prompt. Returns the
        number of messages loaded."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise LocalLLMError(f"cannot read {path}: {e.strerror}.") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LocalLLMError(f"{path} is not a JSON file ({e}).") from None
        messages = parse_messages(data, str(path))
        system = self.system
        self.messages = messages
        if self.system is None and system:
            self.set_system(system)
        return len(messages)


def parse_messages(data: Any, origin: str) -> list[dict[str, Any]]:
    """Validated messages from a saved conversation (dict with "messages", or a bare list)."""
    raw = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise LocalLLMError(f"{origin} holds no conversation (expected a list of messages).")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise LocalLLMError(
                f"message {i + 1} in {origin} needs a role (system, user or assistant) and text content."
            )
        if m["role"] == "system" and i != 0:
            raise LocalLLMError(f"message {i + 1} in {origin} is a system message; only the first may be.")
        message = {"role": m["role"], "content": m["content"]}
        if (
            m["role"] == "assistant"
            and isinstance(m.get("reasoning_content"), str)
            and m["reasoning_content"]
        ):
            message["reasoning_content"] = m["reasoning_content"]
        if m.get("interrupted"):
            message["interrupted"] = True
        messages.append(message)
    return messages


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the template gets it: role and content, and an assistant's thinking under the
    names templates read (Qwen3's reasoning_content, gpt-oss's thinking)."""
    plain = {"role": message["role"], "content": message["content"]}
    if message.get("reasoning_content"):
        plain["reasoning_content"] = plain["thinking"] = message["reasoning_content"]
    return plain


def _copy(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(m) for m in messages]
