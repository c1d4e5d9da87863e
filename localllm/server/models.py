"""GET /v1/models and /v1/models/{model}: the served models and their --alias names, as OpenAI lists
them; with several models, each card says whether it is loaded (`state`: loaded, loading, unloaded)."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from localllm.server.model_pool import Member, ModelPool, request_pool


async def list_models(request: Request) -> dict[str, Any]:
    pool = request_pool(request)
    if pool.pinned:
        state = pool.default
        names = dict.fromkeys((state.config.model_id, *state.config.served_aliases))
        return {"object": "list", "data": [model_card(pool, pool.members[0], name) for name in names]}
    return {"object": "list", "data": [model_card(pool, m, m.name) for m in pool.members]}


async def get_model(model: str, request: Request) -> dict[str, Any]:
    pool = request_pool(request)
    member = pool.find(model)
    if member is None:
        raise pool.not_found(model)
    listed = model if model in member.state.config.served_aliases else member.name
    return model_card(pool, member, listed)


def model_card(pool: ModelPool, member: Member, name: str) -> dict[str, Any]:
    state = member.state
    card: dict[str, Any] = {"id": name, "object": "model", "created": state.created, "owned_by": "localllm"}
    if state.max_model_len is not None:
        card["max_model_len"] = state.max_model_len
    if not pool.pinned:
        card["state"] = member.status
    return card
