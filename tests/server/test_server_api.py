"""The API surface beyond chat and completions, on the tiny model: /v1/embeddings (and LLM.embed),
n > 1, suffix (fill-in-the-middle), system_fingerprint, /v1/responses and /v1/messages."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from paths import DATA
from server_harness import CHAT as CHAT_MSG
from server_harness import MODEL_ID, Running, engine_factory, post, running_server

from localllm.engine.embedding import embed_token_ids, model_pooling
from localllm.tokenizer.fim import fim_tokens, infill_ids


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path, index_dir: Path) -> Iterator[Running]:
    # a context of 1024 (the tiny model trained 256) leaves room for prompts with tools
    with running_server(engine_factory(tiny_model_path, index_dir, ctx_size=1024)) as running:
        yield running


@pytest.fixture
def client(srv: Running) -> openai.OpenAI:
    return srv.client()


def error_of(r: object) -> dict:
    body = r.json()  # type: ignore[attr-defined]
    return body["error"]


# ------------------------------------------------------------------------------------------ embeddings

TEXTS = ["the cat sat on the mat", "a dog", "hello there, how are you today?", "x"]


def test_embeddings_openai_client(client: openai.OpenAI, srv: Running) -> None:
    r = client.embeddings.create(model=MODEL_ID, input=TEXTS)
    assert r.object == "list" and r.model == MODEL_ID and [d.index for d in r.data] == [0, 1, 2, 3]
    vectors = np.array([d.embedding for d in r.data])
    assert vectors.shape == (4, srv.engine.args.dim)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    ids = [srv.engine.tokenize_prompt(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(i) for i in ids)
    # each input alone gives the same vector as in the batch; token ids give the same as text
    single = client.embeddings.create(model=MODEL_ID, input=TEXTS[2]).data[0].embedding
    assert np.allclose(single, vectors[2], atol=1e-5)
    by_ids = client.embeddings.create(model=MODEL_ID, input=ids)
    assert np.allclose([d.embedding for d in by_ids.data], vectors, atol=1e-5)
    one_ids = client.embeddings.create(model=MODEL_ID, input=ids[1])
    assert np.allclose(one_ids.data[0].embedding, vectors[1], atol=1e-5)
    srv.wait_idle()


def test_embeddings_base64(srv: Running) -> None:
    floats = post(srv, "/v1/embeddings", {"input": TEXTS[:2]}).json()
    b64 = post(srv, "/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": "hi", "dimensions": 3}, 400, "dimensions"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": [10**9]}, 400, "input"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "hi", "pooling": "mean"}, 400, "pooling"),
        ({"input": "hi", "model": "nope"}, 404, "model"),
        ({"input": "word " * 5000}, 400, "input"),
    ],
)
def test_embeddings_errors(srv: Running, body: dict, status: int, param: str) -> None:
    r = post(srv, "/v1/embeddings", body)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param


def test_embeddings_dimensions_of_the_model_accepted(srv: Running) -> None:
    r = post(srv, "/v1/embeddings", {"input": "hi", "dimensions": srv.engine.args.dim})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == srv.engine.args.dim


def test_embeddings_batched_in_few_passes(tiny_model_path: Path, index_dir: Path) -> None:
    """64 inputs take as many forward passes as the token budget needs, not 64; results equal one by one,
    for every pooling; long inputs are chunked."""
    engine = engine_factory(tiny_model_path, index_dir, max_num_batched_tokens=64)()
    inputs = [engine.tokenize_prompt(f"n{i}" * (1 + i % 3)) for i in range(64)]
    inputs.append(engine.tokenize_prompt("a long input " * 15))  # longer than a step's budget
    calls = []
    real = engine.runner.hidden_states
    engine.runner.hidden_states = lambda s, rows: calls.append(len(s)) or real(s, rows)  # type: ignore[method-assign]
    for pooling in ("last", "mean", "cls"):
        calls.clear()
        batched = embed_token_ids(engine, inputs, pooling)
        total = sum(len(i) for i in inputs)
        assert len(calls) <= -(-total // 64) + 1 and max(calls) > 4
        for k in (0, 7, 64):
            alone = embed_token_ids(engine, [inputs[k]], pooling)[0]
            assert np.allclose(alone, batched[k], atol=1e-4), pooling
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_embeddings_leave_cached_prefixes_alone(tiny_model_path: Path, index_dir: Path) -> None:
    """Embedding inputs reuse free blocks that cache nothing before they evict a cached prompt prefix:
    their blocks, freed, go to the front of the free list."""
    engine = engine_factory(tiny_model_path, index_dir, num_kv_blocks=16, block_size=4)()
    prompt = engine.tokenize_prompt("a prompt whose prefix stays cached " * 2)
    assert len(prompt) >= 20
    params = {"temperature": 0, "max_tokens": 1}
    engine.generate([prompt], params)
    cached_before = engine.generate([prompt], params)[0].cached_tokens
    assert cached_before >= 16
    inputs = [engine.tokenize_prompt("embed me please " * 2)] * 2  # more blocks than never-used remain
    for _ in range(4):
        embed_token_ids(engine, inputs)
    assert engine.generate([prompt], params)[0].cached_tokens == cached_before


def test_embedding_pooling_from_metadata() -> None:
    assert model_pooling({}, "llama") == "last"
    assert model_pooling({"bert.pooling_type": 1}, "bert") == "mean"
    assert model_pooling({"qwen3.pooling_type": 3}, "qwen3") == "last"
    assert model_pooling({"x.pooling_type": 0}, "x") == "last"


def test_llm_embed(tiny_model_path: Path, index_dir: Path) -> None:
    from localllm.llm import LLM

    llm = LLM(tiny_model_path, backend="numpy", threads=1, index_dir=index_dir)
    many = llm.embed(TEXTS)
    assert many.shape == (4, llm.engine.args.dim) and many.dtype == np.float32
    assert np.allclose(llm.embed(TEXTS[1]), many[1:2], atol=1e-5)
    ids = llm.tokenizer.encode(TEXTS[0])
    assert np.allclose(llm.embed(ids), many[:1], atol=1e-5)
    raw = llm.embed(TEXTS, pooling="mean", normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1)


# ----------------------------------------------------------------------------------------------- n > 1

LONG_CHAT = [{"role": "user", "content": "a prompt long enough to fill at least two cache blocks " * 2}]


def test_chat_n_choices_share_the_prompt(client: openai.OpenAI, srv: Running) -> None:
    bm = srv.engine.block_manager
    kw = {"model": MODEL_ID, "messages": LONG_CHAT, "max_tokens": 5, "seed": 7, "temperature": 1.5}
    hits = bm.num_prefix_hits
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    one = client.chat.completions.create(n=1, **kw)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens > 32  # the prompt counts once
    assert 3 <= r.usage.completion_tokens <= 15  # summed over the choices
    full_blocks = (one.usage.prompt_tokens - 1) // 16 * 16
    # choices 2 and 3 found the first one's prompt blocks in the prefix cache
    assert bm.num_prefix_hits - hits >= 2 * full_blocks
    assert r.choices[0].message.content == one.choices[0].message.content  # choice 0 keeps the seed
    assert len({c.message.content for c in r.choices}) > 1  # later choices get their own seeds
    assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")
    srv.wait_idle()


def test_chat_n_stream(client: openai.OpenAI, srv: Running) -> None:
    kw = {"model": MODEL_ID, "messages": CHAT_MSG, "max_tokens": 6, "seed": 3, "temperature": 1.0, "n": 2}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert {c.system_fingerprint for c in chunks} == {whole.system_fingerprint}
    srv.wait_idle()


def test_completions_n_with_prompt_list(client: openai.OpenAI, srv: Running) -> None:
    kw = {"model": MODEL_ID, "max_tokens": 4, "seed": 1, "temperature": 1.0, "echo": True}
    r = client.completions.create(prompt=["Hello", "Bye now"], n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompts = ["Hello", "Hello", "Bye now", "Bye now"]
    assert all(c.text.startswith(p) for c, p in zip(r.choices, prompts, strict=True))
    lens = [len(srv.engine.tokenize_prompt(p)) for p in ("Hello", "Bye now")]
    assert r.usage.prompt_tokens == sum(lens)
    stream = list(client.completions.create(prompt=["Hello", "Bye now"], n=2, stream=True, **kw))
    texts = ["", "", "", ""]
    for c in stream:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in r.choices]
    assert r.system_fingerprint == stream[0].system_fingerprint
    srv.wait_idle()


# -------------------------------------------------------------------------- finish reasons on the wire


def test_loop_guard_finish_reason_is_length_on_the_wire(client: openai.OpenAI, srv: Running) -> None:
    # greedy, the tiny model loops on "hello" and the loop guard ends it: clients get "length" (a reason
    # they know) and our own reason in native_finish_reason
    r = client.completions.create(model=MODEL_ID, prompt="hello", temperature=0, max_tokens=300)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].model_extra["native_finish_reason"] == "repetition"
    stream = client.completions.create(
        model=MODEL_ID, prompt="hello", temperature=0, max_tokens=300, stream=True
    )
    last = [c for c in stream if c.choices][-1].choices[0]
    assert (last.finish_reason, last.model_extra["native_finish_reason"]) == ("length", "repetition")
    # a reason clients know is sent as is, with no extra field
    r = client.completions.create(model=MODEL_ID, prompt="hello", temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and "native_finish_reason" not in r.choices[0].model_extra
    # the Responses and Messages APIs report such a reply as cut short too, not as finished
    chat = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], temperature=0, max_tokens=300
    )
    assert chat.choices[0].model_extra.get("native_finish_reason") == "repetition"
    resp = client.responses.create(model=MODEL_ID, input="hello", temperature=0, max_output_tokens=300)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 300, "temperature": 0}
    assert post(srv, "/v1/messages", body).json()["stop_reason"] == "max_tokens"
    srv.wait_idle()


# ------------------------------------------------------------------------------------- suffix (FIM)


def test_suffix_needs_fim_tokens(srv: Running) -> None:
    err = error_of(post(srv, "/v1/completions", {"prompt": "def f(x):", "suffix": "    return y"}))
    assert err["param"] == "suffix" and "fill-in-the-middle" in err["message"]
    err = error_of(post(srv, "/v1/completions", {"prompt": "a", "suffix": "b", "echo": True}))
    assert err["param"] == "echo"
    assert post(srv, "/v1/completions", {"prompt": "a", "suffix": "", "max_tokens": 1}).status_code == 200


def test_fim_tokens_and_prompt(srv: Running) -> None:
    tok = srv.engine.tokenizer
    assert fim_tokens(tok, srv.engine.gguf.metadata) is None
    ids = {f"tokenizer.ggml.fim_{r}_token_id": i for r, i in (("pre", 5), ("suf", 6), ("mid", 7))}
    fim = fim_tokens(tok, ids)
    assert fim is not None and (fim.pre, fim.suf, fim.mid) == (5, 6, 7)
    prompt = infill_ids(tok, fim, "ab", "cd")
    assert prompt == [5, *tok.encode("ab", add_special=False), 6, *tok.encode("cd", add_special=False), 7]
    assert infill_ids(tok, fim, [9, 10], "cd")[:3] == [5, 9, 10]


class _Vocab:
    vocab_size, bos_id, add_bos = 100, 1, True

    def piece_to_id(self, piece: str) -> int | None:
        return {"<|fim_prefix|>": 10, "<|fim_suffix|>": 11, "<|fim_middle|>": 12}.get(piece)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_fim_tokens_by_spelling() -> None:
    fim = fim_tokens(_Vocab(), {})  # type: ignore[arg-type]
    assert fim is not None and (fim.pre, fim.suf, fim.mid) == (10, 11, 12)
    assert infill_ids(_Vocab(), fim, "a", "b") == [1, 10, 97, 11, 98, 12]  # type: ignore[arg-type]


@pytest.mark.slow
def test_suffix_fills_the_middle_on_qwen25_coder(qwen25c_path: Path, model_index_dir: Path) -> None:
    """Qwen2.5-Coder-0.5B, through the server, writes a sensible middle."""
    factory = engine_factory(qwen25c_path, model_index_dir, backend="numba", max_num_seqs=1, ctx_size=512)
    with running_server(factory, model_id="qwen") as running:
        body = {"prompt": "def is_even(n):\n    return ", "suffix": "\n\nprint(is_even(4))\n"}
        r = post(running, "/v1/completions", {**body, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("n % 2 == 0")


# ------------------------------------------------------------------------------------ /v1/responses

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def test_responses_text_matches_chat(client: openai.OpenAI, srv: Running) -> None:
    kw = {"temperature": 0, "max_output_tokens": 8}
    r = client.responses.create(model=MODEL_ID, input="hello there", instructions="Be brief.", **kw)
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        temperature=0,
        max_tokens=8,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_ID
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    items = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "hello there"}]},
    ]
    assert client.responses.create(model=MODEL_ID, input=items, **kw).output_text == r.output_text
    srv.wait_idle()


def test_responses_stream_events(client: openai.OpenAI, srv: Running) -> None:
    kw = {"model": MODEL_ID, "input": "hello there", "temperature": 0, "max_output_tokens": 8}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    srv.wait_idle()


def test_responses_forced_function_call(client: openai.OpenAI, srv: Running) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    kw = {
        "model": MODEL_ID,
        "input": "weather?",
        "tools": [tool],
        "temperature": 1.0,
        "max_output_tokens": 200,
    }
    r = client.responses.create(tool_choice={"type": "function", "name": "get_weather"}, **kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(tool_choice="required", stream=True, **kw))
    done = [
        e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert done and json.loads(done[0].arguments)["unit"] in ("C", "F")
    # greedy, streamed and not: the arguments arrive in pieces as the call is written and assemble to
    # the unstreamed call's; the completed response holds the call as streamed
    greedy = {**kw, "temperature": 0, "tool_choice": "required"}
    whole = next(i for i in client.responses.create(**greedy).output if i.type == "function_call")
    events = list(client.responses.create(stream=True, **greedy))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    added = next(e.item for e in events if e.type == "response.output_item.added")
    final = next(i for i in events[-1].response.output if i.type == "function_call")
    assert len(pieces) > 2 and "".join(pieces) == whole.arguments == final.arguments
    assert added.type == "function_call" and (added.id, added.call_id) == (final.id, final.call_id)
    # the call and its output fed back as input items
    back = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'},
    ]
    again = post(srv, "/v1/responses", {"input": back, "tools": [tool], "max_output_tokens": 2})
    assert again.status_code == 200, again.text
    srv.wait_idle()


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "unknown": 1}, "unknown"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "sound"}}}, "response_format"),
    ],
)
def test_responses_errors(srv: Running, body: dict, param: str) -> None:
    r = post(srv, "/v1/responses", body)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param


# ------------------------------------------------------------------------------------- /v1/messages

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def anthropic_events(text: str) -> list[tuple[str, dict]]:
    """(event name, payload) of each SSE event, checking that the name matches the payload's type."""
    out = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, payload = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert payload["type"] == name
        out.append((name, payload))
    return out


def test_messages_text(srv: Running, client: openai.OpenAI) -> None:
    body = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = post(srv, "/v1/messages", body, headers=ANTHROPIC)
    assert r.status_code == 200, r.text
    m = r.json()
    chat = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        temperature=0,
        max_tokens=8,
    )
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": chat.choices[0].message.content}]
    assert m["stop_reason"] == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] == chat.usage.prompt_tokens
    assert m["usage"]["output_tokens"] == chat.usage.completion_tokens
    events = anthropic_events(post(srv, "/v1/messages", {**body, "stream": True}).text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(p["delta"]["text"] for name, p in events if name == "content_block_delta")
    assert text == m["content"][0]["text"]
    assert events[-2][1]["delta"]["stop_reason"] == m["stop_reason"]
    srv.wait_idle()


def test_messages_stop_sequence(srv: Running) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0}
    body["metadata"] = {"user_id": "u1"}
    text = post(srv, "/v1/messages", body).json()["content"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    m = post(srv, "/v1/messages", {**body, "stop_sequences": [stop]}).json()
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == stop


def test_messages_tool_use(srv: Running) -> None:
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_PARAMS}
    body = {
        "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 200,
        "temperature": 1.0,
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    m = post(srv, "/v1/messages", body).json()
    uses = [b for b in m["content"] if b["type"] == "tool_use"]
    assert m["stop_reason"] == "tool_use" and uses and uses[0]["input"]["city"] in ("Paris", "Rome")
    events = anthropic_events(post(srv, "/v1/messages", {**body, "stream": True}).text)
    starts = [p["content_block"] for name, p in events if name == "content_block_start"]
    assert any(b["type"] == "tool_use" and b["name"] == "get_weather" for b in starts)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # greedy, streamed and not: the input arrives in input_json_delta pieces as the call is written,
    # and they assemble to the unstreamed block's input
    greedy = {**body, "temperature": 0}
    whole = next(b for b in post(srv, "/v1/messages", greedy).json()["content"] if b["type"] == "tool_use")
    events = anthropic_events(post(srv, "/v1/messages", {**greedy, "stream": True}).text)
    deltas = [p["delta"] for name, p in events if name == "content_block_delta"]
    pieces = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == whole["input"]
    # the tool_use and its tool_result fed back
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]},
    ]
    r = post(srv, "/v1/messages", {"messages": history, "tools": [tool], "max_tokens": 2})
    assert r.status_code == 200, r.text
    srv.wait_idle()


@pytest.mark.parametrize(
    "body,status,kind",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),  # no max_tokens
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "top_q": 1},
            400,
            "invalid_request_error",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "model": "claude-x"},
            404,
            "not_found_error",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 1},
            400,
            "invalid_request_error",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "thinking": {"type": "eager"},
            },
            400,
            "invalid_request_error",
        ),
    ],
)
def test_messages_errors_are_anthropic_shaped(srv: Running, body: dict, status: int, kind: str) -> None:
    r = post(srv, "/v1/messages", body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
    if "top_q" in body:
        assert "top_q" in err["error"]["message"]


def test_x_api_key(tiny_model_path: Path, index_dir: Path) -> None:
    with running_server(engine_factory(tiny_model_path, index_dir), api_key="sekret") as running:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert post(running, "/v1/messages", body, headers={"x-api-key": "sekret"}).status_code == 200
        bearer = {"authorization": "Bearer sekret"}
        assert post(running, "/v1/messages", body, headers=bearer).status_code == 200
        wrong = post(running, "/v1/messages", body, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert (
            post(running, "/v1/responses", {"input": "hi"}, headers={"x-api-key": "nope"}).status_code == 401
        )


def test_messages_tool_result_blocks_must_be_text(srv: Running) -> None:
    result = {"type": "tool_result", "tool_use_id": "t", "content": ["not a block"]}
    r = post(srv, "/v1/messages", {"messages": [{"role": "user", "content": [result]}], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_embeddings_match_llama_server(smollm2_path: Path, model_index_dir: Path) -> None:
    """SmolLM2's embeddings against llama-server's (tests/fixtures/make_embedding_reference.py)."""
    from localllm.llm import LLM

    reference = json.loads((DATA / "smollm2_embeddings.json").read_text())
    llm = LLM(smollm2_path, index_dir=model_index_dir)
    for pooling in ("last", "mean"):
        theirs = np.asarray(reference[pooling])
        ours = llm.embed(reference["texts"], pooling=pooling)
        assert np.all(np.sum(theirs * ours, axis=1) > 0.998), pooling
    assert np.array_equal(llm.embed(reference["texts"]), llm.embed(reference["texts"], pooling="last"))


def test_every_openai_field_is_declared() -> None:
    """Each parameter the installed `openai` client can send to /v1/responses and /v1/embeddings is
    declared (honoured, a no-op, or a 400 naming it), so none is refused as unknown unnoticed."""
    import typing

    from openai.types import embedding_create_params
    from openai.types.responses import response_create_params

    from localllm.server.embeddings import EmbeddingRequest
    from localllm.server.responses import ResponsesRequest

    responses = typing.get_type_hints(response_create_params.ResponseCreateParamsBase)
    assert set(responses) <= set(ResponsesRequest.model_fields)
    embeddings = typing.get_type_hints(embedding_create_params.EmbeddingCreateParams)
    assert set(embeddings) <= set(EmbeddingRequest.model_fields)


@pytest.mark.parametrize(
    "field,value",
    [("moderation", {"x": 1}), ("background", True), ("include", ["reasoning.encrypted_content"])],
)
def test_responses_refused_fields_name_themselves(srv: Running, field: str, value: object) -> None:
    r = post(srv, "/v1/responses", {"input": "hi", field: value})
    assert r.status_code == 400 and error_of(r)["param"] == field


def test_messages_count_tokens(srv: Running) -> None:
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": "hello there"}]}
    counted = post(srv, "/v1/messages/count_tokens", body).json()["input_tokens"]
    m = post(srv, "/v1/messages", {**body, "max_tokens": 1}).json()
    assert counted == m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] > 0
    bad = post(srv, "/v1/messages/count_tokens", {**body, "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def test_embedding_groups() -> None:
    from localllm.server.embeddings import groups

    ids = [[1] * 3, [2] * 3, [3] * 5, [4] * 20, [5]]
    assert groups(ids, 8) == [[[1] * 3, [2] * 3], [[3] * 5], [[4] * 20], [[5]]]
    assert [len(g) for g in groups([[1]] * 10, 4)] == [4, 4, 2]


def test_anthropic_client(srv: Running) -> None:
    """The official `anthropic` client against /v1/messages: a reply, a stream, a tool call, a count."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # extra_body: this client version no longer sends sampling fields
    kw = {"model": MODEL_ID, "max_tokens": 8, "extra_body": greedy}
    messages = [{"role": "user", "content": "hello there"}]
    m = client.messages.create(messages=messages, system="Be brief.", **kw)
    assert (
        m.role == "assistant" and m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens")
    )
    with client.messages.stream(messages=messages, system="Be brief.", **kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text == final.content[0].text
    assert final.usage.output_tokens == m.usage.output_tokens
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_PARAMS}
    choice = {"type": "tool", "name": "get_weather"}
    kw = {**kw, "max_tokens": 200, "extra_body": {"temperature": 1.0}}
    called = client.messages.create(messages=messages, tools=[tool], tool_choice=choice, **kw)
    use = next(b for b in called.content if b.type == "tool_use")
    assert called.stop_reason == "tool_use" and use.input["city"] in ("Paris", "Rome")
    with client.messages.stream(messages=messages, tools=[tool], tool_choice=choice, **kw) as stream:
        final = stream.get_final_message()  # the client assembles the input from input_json_delta
    use = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and use.input["city"] in ("Paris", "Rome")
    count = client.messages.count_tokens(model=MODEL_ID, messages=messages, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(messages=messages, max_tokens=1, model="claude-nope")
    srv.wait_idle()


def test_anthropic_fields_are_declared() -> None:
    """Each parameter the installed `anthropic` client can send is declared in MessagesRequest."""
    import typing

    params = pytest.importorskip("anthropic.types.message_create_params")
    from localllm.server.messages import MessagesRequest

    assert set(typing.get_type_hints(params.MessageCreateParamsBase)) <= set(MessagesRequest.model_fields)


def test_messages_output_config_format(srv: Running) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False
    body = {"messages": [{"role": "user", "content": "json?"}], "max_tokens": 60, "temperature": 0}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    m = post(srv, "/v1/messages", {**body, "output_config": fmt}).json()
    assert isinstance(json.loads(m["content"][0]["text"])["ok"], bool)
    r = post(srv, "/v1/messages", {**body, "output_config": {"effort": "high"}})
    assert r.status_code == 400 and "effort" in r.json()["error"]["message"]


def test_text_streams_live_with_tools_offered(srv: Running, client: openai.OpenAI) -> None:
    """With tools offered (tool_choice auto) a reply that makes no call still streams as it comes."""
    fn = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    kw = {"model": MODEL_ID, "input": "hello there", "tools": [fn], "temperature": 0, "max_output_tokens": 12}
    whole = client.responses.create(**kw)
    assert not [i for i in whole.output if i.type == "function_call"]
    events = list(client.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == events[-1].response.output_text
    tool = {"name": "get_weather", "input_schema": WEATHER_PARAMS}
    body = {"messages": [{"role": "user", "content": "hello there"}], "tools": [tool]}
    body |= {"max_tokens": 12, "temperature": 0}
    m = post(srv, "/v1/messages", body).json()
    streamed = anthropic_events(post(srv, "/v1/messages", {**body, "stream": True}).text)
    texts = [p["delta"]["text"] for name, p in streamed if name == "content_block_delta"]
    assert len(texts) > 1 and "".join(texts) == m["content"][0]["text"]
    srv.wait_idle()
