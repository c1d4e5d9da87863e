"""The llama-server and vLLM extension fields of docs/server.md's dialect table, on the tiny model: each
honoured field changes what it should, and a value that asks for what this server does not do is a
400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_harness import BAN_END, CHAT, Running, engine_factory, error_of, post, running_server

EOS_FIRST = {"2": 100}  # <|im_end|>, the tiny model's end of turn, comes first


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    with running_server(engine_factory(tiny_model_path, index_dir, ctx_size=256)) as running:
        yield running


def completion(srv: Running, **body: object) -> dict:
    r = post(srv, "/v1/completions", {"prompt": "hello", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv: Running, **body: object) -> dict:
    r = post(srv, "/v1/chat/completions", {"messages": CHAT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# --------------------------------------------------------------------------------- llama-server


def test_n_predict_is_max_tokens(srv: Running) -> None:
    for n in (3, 7):
        c = completion(srv, n_predict=n, logit_bias=BAN_END)
        assert (c["usage"]["completion_tokens"], c["choices"][0]["finish_reason"]) == (n, "length")
        same = completion(srv, max_tokens=n, logit_bias=BAN_END)
        assert c["choices"][0]["text"] == same["choices"][0]["text"]
        reply = chat(srv, n_predict=n, logit_bias=BAN_END)
        assert reply["usage"]["completion_tokens"] == n
    assert completion(srv, n_predict=5, max_tokens=5, logit_bias=BAN_END)["usage"]["completion_tokens"] == 5
    assert (
        error_of(post(srv, "/v1/completions", {"prompt": "hi", "n_predict": 5, "max_tokens": 6}), 400)[
            "param"
        ]
        == "n_predict"
    )
    assert error_of(post(srv, "/v1/chat/completions", {"messages": CHAT, "n_predict": 0}), 400)["param"] == (
        "n_predict"
    )


def test_n_predict_minus_one_is_no_limit(srv: Running) -> None:
    """Completions default to 16 tokens; n_predict -1 (llama-server's "no limit") runs to the context."""
    c = completion(srv, n_predict=-1, ignore_eos=True)
    prompt = c["usage"]["prompt_tokens"]
    assert c["usage"]["completion_tokens"] == 256 - prompt and c["choices"][0]["finish_reason"] == "length"
    assert completion(srv, ignore_eos=True)["usage"]["completion_tokens"] == 16


@contextmanager
def model_never_ends(srv: Running) -> Iterator[None]:
    """The tiny random model with its end-of-text tokens out of reach, through the engine's own sampling
    step (the request's fields untouched)."""
    runner = srv.engine.runner
    sample = type(runner)._sample

    def no_end(item: Any, logits: np.ndarray) -> Any:
        logits = logits.copy()
        logits[[int(t) for t in BAN_END]] = -np.inf
        return sample(item, logits)

    runner._sample = no_end
    try:
        yield
    finally:
        del runner._sample


def test_ctx_shift_disabled_stream_as_llama_server_sends_it(srv: Running) -> None:
    """llama.cpp's server suite's test_ctx_shift_disabled_stream (tools/server/tests/unit/test_ctx_shift.py),
    replayed as it is sent: the same body against a 256-token context (its slot's: n_ctx 512 over 2
    slots), so n_predict 256 asks for more than the context leaves. llama-server takes n_predict as a
    cap and stops at the context's end; so must this server (no 400), each chunk before the last with
    no finish_reason and the last saying "length" after some text. Asserted as that test does, and
    that the "length" chunk comes (it would pass without one)."""
    from server_harness import sse_payloads

    with model_never_ends(srv):  # as stories260K does not within its test; the request stays as sent
        r = post(srv, "/v1/completions", {"n_predict": 256, "prompt": "Once", "stream": True})
    assert r.status_code == 200, r.text
    content, reasons = "", []
    for data in sse_payloads(r.text):
        choice = data["choices"][0]
        reasons.append(choice["finish_reason"])
        if choice["finish_reason"] == "length":
            assert len(content) > 0
        else:
            assert choice["finish_reason"] is None
            content += choice["text"]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    # not streamed, the same with ignore_eos (no end, no loop guard) runs to the context's end exactly;
    # max_tokens keeps OpenAI's 400
    whole = completion(srv, n_predict=256, prompt="Once", ignore_eos=True)
    usage = whole["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256, whole
    over = post(srv, "/v1/completions", {"max_tokens": 256, "prompt": "Once"})
    assert error_of(over, 400)["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "field,honoured,refused",
    [("cache_prompt", True, False), ("id_slot", -1, 0), ("timings_per_token", False, True)]
    + [("return_progress", False, True)],
)
def test_llama_server_flags(srv: Running, field: str, honoured: object, refused: object) -> None:
    """The value that means what this server always does is accepted (and changes nothing); any other
    is a 400 naming the field."""
    base = {"max_tokens": 4, "logit_bias": BAN_END}
    plain = completion(srv, **base)["choices"][0]["text"]
    assert completion(srv, **base, **{field: honoured})["choices"][0]["text"] == plain
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        err = error_of(post(srv, path, {**body, field: refused}), 400)
        assert err["param"] == field and "cannot be honoured" in err["message"]


# ------------------------------------------------------------------------------------------ vLLM


def test_min_tokens_holds_back_the_end(srv: Running) -> None:
    # completion_tokens counts the end-of-turn token too
    first = completion(srv, max_tokens=10, logit_bias=EOS_FIRST)
    assert (first["usage"]["completion_tokens"], first["choices"][0]["text"]) == (1, "")
    c = completion(srv, max_tokens=10, logit_bias=EOS_FIRST, min_tokens=4)
    assert (c["usage"]["completion_tokens"], c["choices"][0]["finish_reason"]) == (5, "stop")
    assert c["choices"][0]["text"]
    reply = chat(srv, max_tokens=10, logit_bias=EOS_FIRST, min_tokens=3)
    assert reply["usage"]["completion_tokens"] == 4
    err = error_of(post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}), 400)
    assert err["param"] == "min_tokens"


def test_skip_special_tokens_false_keeps_their_text(srv: Running) -> None:
    body = {"max_tokens": 2, "logit_bias": {"1": 100}}  # <|im_start|>, a control token
    assert completion(srv, **body)["choices"][0]["text"] == ""
    kept = completion(srv, **body, skip_special_tokens=False)["choices"][0]["text"]
    assert kept == "<|im_start|><|im_start|>"
    assert chat(srv, **body, skip_special_tokens=False)["choices"][0]["message"]["content"] == kept


PREFILL = [*CHAT, {"role": "assistant", "content": "Sure, the answer is"}]


def rendered_ids(srv: Running, messages: list[dict], generation_prompt: bool, cut: bool) -> list[int]:
    from localllm.tokenizer.chat_template import apply_chat_template

    return apply_chat_template(
        srv.engine.tokenizer, srv.state.template, messages, generation_prompt, continue_final=cut
    )


def test_continue_final_message_continues_the_assistant_turn(srv: Running) -> None:
    base = {"max_tokens": 4, "logit_bias": BAN_END}
    cont = chat(srv, messages=PREFILL, continue_final_message=True, add_generation_prompt=False, **base)
    want = rendered_ids(srv, PREFILL, False, True)
    assert srv.engine.tokenizer.decode(want).endswith("Sure, the answer is")  # no end of turn after it
    assert cont["usage"]["prompt_tokens"] == len(want)
    # add_generation_prompt may be left out when continuing; the reply is the same
    same = chat(srv, messages=PREFILL, continue_final_message=True, **base)
    assert same["choices"][0]["message"] == cont["choices"][0]["message"]
    # a new turn after the closed assistant message is another prompt
    new_turn = chat(srv, messages=PREFILL, **base)
    assert new_turn["usage"]["prompt_tokens"] == len(rendered_ids(srv, PREFILL, True, False))
    assert new_turn["usage"]["prompt_tokens"] != cont["usage"]["prompt_tokens"]
    both = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True}
    assert error_of(post(srv, "/v1/chat/completions", both), 400)["param"] == "continue_final_message"
    user_last = {"messages": CHAT, "continue_final_message": True}
    assert error_of(post(srv, "/v1/chat/completions", user_last), 400)["param"] == "messages"


def test_add_generation_prompt_false_renders_no_new_turn(srv: Running) -> None:
    reply = chat(srv, max_tokens=2, add_generation_prompt=False, logit_bias=BAN_END)
    assert reply["usage"]["prompt_tokens"] == len(rendered_ids(srv, CHAT, False, False))
    assert reply["usage"]["prompt_tokens"] < chat(srv, max_tokens=2)["usage"]["prompt_tokens"]


def test_messages_prefill_continues_the_assistant_turn(srv: Running) -> None:
    """Anthropic's meaning of a final assistant message: the reply continues it."""
    messages = [{"role": "user", "content": CHAT[0]["content"]}, PREFILL[-1]]
    m = post(srv, "/v1/messages", {"messages": messages, "max_tokens": 4, "temperature": 0}).json()
    read = m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"]
    assert read == len(rendered_ids(srv, PREFILL, False, True))


@pytest.mark.parametrize("field,value", [("mirostat", 2), ("n_probs", 3), ("use_beam_search", True)])
def test_unmapped_dialect_fields_stay_refused(srv: Running, field: str, value: object) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        assert error_of(post(srv, path, {**body, field: value}), 400)["param"] == field


# ------------------------------------------------------------------------------------------ routers

# What vllm-router 0.1.17 and sglang-router add to each forwarded request (recorded from the bodies they
# sent to a stub worker), at the values they send: all mean what this server always does.
ROUTER_CHAT = {
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
    "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
    "include_reasoning": True, "logprobs": False, "stream": False,
}  # fmt: skip
ROUTER_COMPLETION = {
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
    "echo": False, "stream": False,
}  # fmt: skip


def test_router_added_fields_change_nothing(srv: Running) -> None:
    base = {"max_tokens": 4, "logit_bias": BAN_END}
    assert chat(srv, **base, **ROUTER_CHAT)["choices"] == chat(srv, **base)["choices"]
    assert completion(srv, **base, **ROUTER_COMPLETION)["choices"] == completion(srv, **base)["choices"]


@pytest.mark.parametrize(
    "path,field,value",
    [("/v1/completions", "no_stop_trim", True), ("/v1/chat/completions", "return_hidden_states", True)]
    + [
        ("/v1/chat/completions", "separate_reasoning", False),
        ("/v1/chat/completions", "stream_reasoning", False),
    ]
    + [("/v1/chat/completions", "include_reasoning", False)],
)
def test_router_fields_asking_for_more_are_refused(
    srv: Running, path: str, field: str, value: object
) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    err = error_of(post(srv, path, {**body, field: value}), 400)
    assert err["param"] == field and "cannot be honoured" in err["message"]
