"""What the server answers, on the wire: usage, finish reasons, logprobs, and the OpenAI choice and
response objects the endpoints build."""

from __future__ import annotations

import time
from typing import Any

from localllm.engine.output import StepOutput, TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM clamps the same way


def usage(last: StepOutput | None) -> dict[str, Any]:
    if last is None:
        return usage_totals(0, 0, 0)
    return usage_totals(last.prompt_tokens, last.generated_tokens, last.cached_tokens)


def usage_totals(prompt: int, generated: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
    totals = {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning:  # of the completion tokens, those of the thinking
        totals["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return totals


def finish_reason(out: StepOutput) -> str | None:
    return out.finish_reason if out.finished else None


WIRE_FINISH_REASONS = {"repetition": "length", "closed_to_fit": "length"}


def cut_short(out: StepOutput) -> bool:
    """The reply ended before the model did: max_tokens, or the loop guard's "repetition"."""
    return WIRE_FINISH_REASONS.get(out.finish_reason or "", out.finish_reason) == "length"


def finish_fields(reason: str | None) -> dict[str, Any]:
    """A choice's `finish_reason` as OpenAI clients know it, plus `native_finish_reason` when mapped."""
    wire = WIRE_FINISH_REASONS.get(reason or "", reason)
    if wire == reason:
        return {"finish_reason": wire}
    return {"finish_reason": wire, "native_finish_reason": reason}


def is_stop_token(out: StepOutput) -> bool:
    """The final output that carries the end-of-text token itself (not part of the completion)."""
    return out.finished and isinstance(out.stop_reason, int)  # set only when a stop token ended it


def token_logprobs(outs: list[StepOutput]) -> list[TokenLogprob]:
    return [o.logprob for o in outs if o.logprob is not None and not is_stop_token(o)]


def _clamp(lp: float) -> float:
    return max(lp, MIN_LOGPROB)


def _token_entry(tokenizer: Any, token_id: int, lp: float) -> dict[str, Any]:
    data = tokenizer.token_bytes(token_id)
    return {"token": data.decode("utf-8", errors="replace"), "logprob": _clamp(lp), "bytes": list(data)}


def chat_logprobs(tokenizer: Any, items: list[TokenLogprob]) -> dict[str, Any]:
    content = []
    for item in items:
        entry = _token_entry(tokenizer, item.token_id, item.logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in item.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: Any, items: list[TokenLogprob], offset: int = 0, first_id: int | None = None
) -> dict[str, Any]:
    """The legacy logprobs object. `first_id`: a prompt's first token, which has no logprob (null, as
    OpenAI answers for echo), put before `items`."""

    def text_of(token_id: int) -> str:
        return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if first_id is not None:
        tokens, lps, tops, offsets = [text_of(first_id)], [None], [None], [offset]
        offset += len(tokens[0])
    for item in items:
        text = text_of(item.token_id)
        tokens.append(text)
        lps.append(_clamp(item.logprob))
        top = {text: _clamp(item.logprob)}
        top.update({text_of(t): _clamp(lp) for t, lp in item.top})
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """Echoed prompt's logprobs followed by the completion's."""
    if head is None or tail is None:
        return head or tail
    return {key: head[key] + tail[key] for key in head}


def chat_choice(index: int, outs: list[StepOutput], logprobs: dict | None) -> dict[str, Any]:
    last = outs[-1] if outs else None
    message = {"role": "assistant", "content": "".join(o.text for o in outs)}
    reasoning = "".join(o.reasoning for o in outs)
    if reasoning:  # the thinking, kept out of the answer (vLLM's and DeepSeek's field)
        message["reasoning_content"] = reasoning
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        **finish_fields(last.finish_reason if last else "stop"),
    }


def chat_response(
    rid: str, model: str, choices: list[dict[str, Any]], totals: dict[str, Any], fingerprint: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": totals,
        "system_fingerprint": fingerprint,
    }


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, **finish_fields(finish)}


def completion_response(
    rid: str, model: str, choices: list[dict[str, Any]], totals: dict[str, Any], fingerprint: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": totals,
        "system_fingerprint": fingerprint,
    }
