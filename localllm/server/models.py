"""GET /v1/models and /v1/models/{model}: the served model and its --alias names, as OpenAI lists them."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from localllm.server.state import ServerState, model_not_found, server_state


async def list_models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    names = dict.fromkeys((state.config.model_id, *state.config.served_aliases))
    return {"object": "list", "data": [model_card(state, name) for name in names]}


async def get_model(model: str, request: Request) -> dict[str, Any]:
    state = server_state(request)
    if not state.config.accepts_model(model):
        raise model_not_found(state.config, model)
    listed = model if model in state.config.served_aliases else state.config.model_id
    return model_card(state, listed)


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    card = {"id": name, "object": "model", "created": state.created, "owned_by": "localllm"}
    if state.max_model_len is not None:
        card["max_model_len"] = state.max_model_len
    return card
