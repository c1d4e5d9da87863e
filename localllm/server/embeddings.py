"""POST /v1/embeddings: OpenAI's embeddings endpoint over the engine's batched prefill.

Every input of a request is embedded in the same few forward passes on the engine thread (see
engine/embedding.py: the final normed hidden states, pooled as the model's metadata says, else the last
token's, and L2-normalised). `input`: a text, a list of texts, a token-id list or a list of them.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from fastapi import Request, Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from localllm.engine.embedding import check_input_length, embed_token_ids
from localllm.errors import LocalLLMError
from localllm.server.errors import APIError
from localllm.server.jobs import ClientGone, run_on_engine, unless_client_gone
from localllm.server.model_pool import model_state
from localllm.server.protocol import NOOP, KeepAlive, _Request, check_token_ids
from localllm.server.state import ServerState

if TYPE_CHECKING:
    from localllm.engine.engine import LLMEngine

log = logging.getLogger("localllm.server")


CLIENT_CLOSED = 499  # nginx's status for a request its client closed (logged, never read)
PASSES_PER_CALL = 1  # forward passes per engine call: a generation step runs between any two passes


class EmbeddingRequest(_Request):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    keep_alive: KeepAlive = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1, description="Only the model's own width is accepted.")
    user: str | None = Field(None, description=NOOP)

    MAX_INPUTS: ClassVar[int] = 2048  # OpenAI's limit per request

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a token-id list (a flat list of ids is one input)."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if not given:
            raise APIError("'input' must not be an empty list", param="input")
        if isinstance(given[0], int):
            return [given]  # type: ignore[list-item]
        if len(given) > self.MAX_INPUTS:
            raise APIError(f"at most {self.MAX_INPUTS} inputs per request", param="input")
        return list(given)  # type: ignore[arg-type]


def input_ids(state: ServerState, llm: LLMEngine, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked against the vocabulary, the context and the request's token
    budget (as a 400 naming input)."""
    out: list[list[int]] = []
    limit, widest = llm.max_model_len, max(state.max_token_bytes, 1)
    budget, total = state.config.max_embedding_tokens, 0
    for item in body.inputs():
        if isinstance(item, str):
            if -(-len(item) // widest) > limit:  # surely too long: refuse before tokenizing
                raise APIError(f"an input of {len(item)} characters cannot fit the context", param="input")
            ids = llm.tokenize_prompt(item)
        else:
            check_token_ids(item, llm.tokenizer.vocab_size, "input")
            ids = list(item)
        try:
            check_input_length(limit, len(ids))
        except LocalLLMError as e:
            raise APIError(str(e), param="input", code=e.code) from None
        total += len(ids)
        if total > budget:
            raise APIError(
                f"the inputs hold more than {budget:,} tokens, the limit of one request "
                "(--max-embedding-tokens): split them over several requests",
                param="input",
            )
        out.append(ids)
    return out


def groups(ids: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive inputs in groups of at most `max_tokens` tokens (an input longer than that alone)."""
    out: list[list[list[int]]] = []
    size = max_tokens
    for item in ids:
        if size + len(item) > max_tokens:
            out.append([])
            size = 0
        out[-1].append(item)
        size += len(item)
    return out


def encode(vector: np.ndarray, encoding_format: str | None) -> list[float] | str:
    """A vector as floats, or as base64 of its little-endian float32 bytes (what the openai client reads)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


async def embed_groups(state: ServerState, request: Request, work: list[list[list[int]]]) -> list[np.ndarray]:
    """Each group in its own engine call (generation steps run between them, so a big request never
    freezes the streams of others for long); the calls stop when the client leaves."""
    vectors: list[np.ndarray] = []
    for done, group in enumerate(work):
        call = run_on_engine(state.submitter, lambda engine, g=group: embed_token_ids(engine, g))
        try:
            vectors += list(await unless_client_gone(call, request))
        except ClientGone:
            log.info("embeddings: client gone after %d of %d passes; the rest dropped", done, len(work))
            raise
    return vectors


async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any] | Response:
    state = await model_state(request, body)
    llm = state.ready().engine
    state.check_model(body.model)
    if body.dimensions is not None and body.dimensions != llm.args.dim:
        raise APIError(
            f"'dimensions' {body.dimensions} is not supported: this model's embeddings have "
            f"{llm.args.dim} dimensions and cannot be shortened",
            param="dimensions",
        )
    ids = await run_in_threadpool(input_ids, state, llm, body)
    started = time.perf_counter()
    vectors = await embed_groups(
        state, request, groups(ids, PASSES_PER_CALL * llm.config.max_num_batched_tokens)
    )
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    num_tokens = sum(len(x) for x in ids)
    elapsed = time.perf_counter() - started
    log.info("embeddings: %d inputs, %d tokens in %.2f s (%.0f tok/s)", len(ids), num_tokens, elapsed,
             num_tokens / max(elapsed, 1e-9))  # fmt: skip
    return {
        "object": "list",
        "data": data,
        "model": state.config.model_id,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
