"""`localllm serve`: the OpenAI-compatible HTTP server (a drop-in for llama-server / vLLM's server)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from localllm.cli import common as c
from localllm.cli.app import app

Port = Annotated[int, typer.Option("--port", "-p", help="TCP port to listen on.")]
Host = Annotated[
    str, typer.Option("--host", help="Address to bind; 0.0.0.0 exposes the server to the network.")
]
Parallel = Annotated[
    int, typer.Option("--parallel", "-np", help="Sequences decoded together (max_num_seqs).")
]
KvCacheMb = Annotated[
    int, typer.Option("--kv-cache-mb", help="KV cache in MiB (0 = ctx-size x parallel tokens).")
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="LOCALLLM_API_KEY", show_envvar=True, help="Require this Bearer key."),
]
MaxQueue = Annotated[
    int, typer.Option("--max-queue", help="Waiting requests allowed before 503 (0 = unbounded).")
]
CorsOrigins = Annotated[
    list[str] | None,
    typer.Option("--cors-origins", help="Allowed browser origin (repeatable, or comma-separated)."),
]
LogLevel = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")]
Model = Annotated[
    str | None, typer.Argument(help="A .gguf path or registry name. [default: the registry's default]")
]


@app.command()
def serve(
    model: Model = None,
    port: Port = 8080,
    host: Host = "127.0.0.1",
    parallel: Parallel = 8,
    ctx_size: c.CtxSize = 0,
    kv_cache_mb: KvCacheMb = 0,
    threads: c.Threads = 0,
    backend: c.Backend = "numba",
    api_key: ApiKey = None,
    max_queue: MaxQueue = 256,
    cors_origins: CorsOrigins = None,
    chat_template: c.ChatTemplateOption = None,
    log_level: LogLevel = "info",
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (binds 127.0.0.1 unless --host says otherwise).

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics.

    Examples:

      localllm serve

      localllm serve smollm2-135m-instruct --port 8000 --parallel 4

      LOCALLLM_API_KEY=secret localllm serve model.gguf --host 0.0.0.0 --cors-origins '*'

      curl localhost:8080/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "Hi"}'
    """
    from localllm.engine.engine import LLMEngine
    from localllm.server.app import ServerConfig
    from localllm.tokenizer.chat_template import chat_template_source

    path, defaults = c.resolve(model)
    engine_config = c.engine_config(
        path, backend, threads, ctx_size, defaults, max_num_seqs=parallel, kv_cache_mb=kv_cache_mb
    )
    config = ServerConfig(
        model_id=served_id(model, path),
        model_aliases=tuple({path.name, path.stem, *([model] if model else [])}),
        api_key=api_key or None,
        cors_origins=tuple(o.strip() for v in cors_origins or [] for o in v.split(",") if o.strip()),
        max_queue=max_queue,
        chat_template=chat_template_source(chat_template, defaults.get("chat_template")),
        host=host,
        port=port,
    )
    c.first_run_notice(backend)
    run_server(lambda: LLMEngine(engine_config), config, log_level)


def served_id(model: str | None, path: Path) -> str:
    """The registry name when MODEL is (or defaults to) a registry entry, else the file stem."""
    from localllm.registry import default_user_registry, load_registry

    registry = load_registry(default_user_registry())
    entry = registry.find(model or registry.default_model)
    return entry.name if entry is not None and entry.file_name == path.name else path.stem


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging, with localllm's loggers printed the same way and no access log (the server
    logs one line per finished request instead)."""
    import uvicorn.config

    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["localllm"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def run_server(factory: Any, config: Any, log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM (uvicorn's graceful shutdown, then the engine's); exits with an error
    if the model fails to load."""
    import uvicorn

    from localllm.errors import LocalLLMError
    from localllm.server.app import create_app

    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(error: BaseException) -> None:
        failures.append(error)
        if server is not None:
            server.should_exit = True

    app_ = create_app(factory, dataclasses.replace(config, on_load_error=on_load_error))
    server = uvicorn.Server(
        uvicorn.Config(
            app_,
            host=config.host,
            port=config.port,
            log_level=log_level.lower(),
            log_config=log_config(log_level),
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    server.run()
    if failures:
        raise LocalLLMError(f"the model failed to load: {failures[0]}")
