"""`localllm serve`: the OpenAI-compatible HTTP server (a drop-in for llama-server / vLLM's server)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from localllm.cli import common as c
from localllm.cli.app import app
from localllm.config import DRAFT_VOCAB

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
MaxEmbeddingTokens = Annotated[
    int, typer.Option("--max-embedding-tokens", help="Input tokens of one /v1/embeddings request, at most.")
]
MaxChoiceTokens = Annotated[
    int, typer.Option("--max-choice-tokens", help="n x max_tokens of one request with n > 1, at most.")
]
CorsOrigins = Annotated[
    list[str] | None,
    typer.Option("--cors-origins", help="Allowed browser origin (repeatable, or comma-separated)."),
]
AllowedHosts = Annotated[
    list[str] | None,
    typer.Option(
        "--allowed-hosts",
        help="Host header names accepted on a loopback bind besides localhost and IP addresses "
        "(DNS-rebinding guard; repeatable or comma-separated; '*' turns the check off).",
    ),
]
MaxConnections = Annotated[
    int,
    typer.Option(
        "--max-connections",
        help="Open connections allowed; at the limit the oldest idle one is closed, else a 503.",
    ),
]
HeaderTimeout = Annotated[
    float, typer.Option("--header-timeout", help="Seconds a client has to send a request's headers.")
]
BodyTimeout = Annotated[
    float, typer.Option("--body-timeout", help="Seconds a client has to send a request's body.")
]
MaxBodyMb = Annotated[float, typer.Option("--max-body-mb", help="Largest request body in MiB (else 413).")]
Alias = Annotated[
    list[str] | None,
    typer.Option("--alias", help="Also serve the model under this name (repeatable), e.g. gpt-4o-mini."),
]
WebUI = Annotated[bool, typer.Option("--webui/--no-webui", help="Serve the chat page at /.")]
MetricsPublic = Annotated[
    bool, typer.Option("--metrics-public", help="/metrics without the API key (for a router or Prometheus).")
]
DrainTimeout = Annotated[
    float,
    typer.Option(
        "--drain-timeout",
        help="SIGTERM: stop taking requests, finish the open ones for at most this many seconds, exit "
        "(0 = end them at once, as Ctrl-C does).",
    ),
]
KvEventsConfig = Annotated[
    str | None,
    typer.Option(
        "--kv-events-config",
        help="Publish KV-cache events (blocks stored/removed) on ZMQ in vLLM's format for KV-aware "
        'routers; vLLM\'s JSON, e.g. \'{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}\' '
        "(needs localllm[events]; docs/scaling.md).",
    ),
]
LogLevel = Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")]
LOG_LEVELS = ("debug", "info", "warning", "error")
Models = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="[MODEL]...",
        help="A .gguf path or registry name; several: each loads on its first request. "
        "[default: the registry's default]",
    ),
]
ModelsDir = Annotated[
    Path | None, typer.Option("--models-dir", help="Also serve each .gguf file in this folder.")
]
KeepAlive = Annotated[
    str,
    typer.Option(
        "--keep-alive",
        help="Several models: how long an idle one stays loaded (seconds or e.g. 10m, 1h; -1 forever).",
    ),
]
MaxLoaded = Annotated[
    int, typer.Option("--max-loaded", help="Several models: loaded at once, at most (0 = no limit).")
]
MaxMemoryMb = Annotated[
    int,
    typer.Option(
        "--max-memory-mb",
        help="Several models: MiB the loaded ones may need together (info's estimate; 0 = no budget).",
    ),
]
LoadTimeout = Annotated[
    float, typer.Option("--load-timeout", help="Seconds a request waits for its model to load.")
]


@app.command()
def serve(
    models: Models = None,
    models_dir: ModelsDir = None,
    keep_alive: KeepAlive = "5m",
    max_loaded: MaxLoaded = 0,
    max_memory_mb: MaxMemoryMb = 0,
    load_timeout: LoadTimeout = 600.0,
    port: Port = 8080,
    host: Host = "127.0.0.1",
    parallel: Parallel = 8,
    ctx_size: c.CtxSize = 0,
    kv_cache_mb: KvCacheMb = 0,
    threads: c.Threads = 0,
    backend: c.Backend = "numba",
    device: c.Device = "auto",
    cache_type_k: c.CacheTypeK = "f16",
    cache_type_v: c.CacheTypeV = "f16",
    kv_disk_mb: c.KvDiskMb = None,
    kv_disk_dir: c.KvDiskDir = None,
    prompt_lookup: c.PromptLookup = False,
    draft_model: c.DraftModel = None,
    draft_max: c.DraftMax = 8,
    draft_vocab: c.DraftVocab = DRAFT_VOCAB,
    api_key: ApiKey = None,
    max_queue: MaxQueue = 256,
    max_embedding_tokens: MaxEmbeddingTokens = 65_536,
    max_choice_tokens: MaxChoiceTokens = 65_536,
    cors_origins: CorsOrigins = None,
    chat_template: c.ChatTemplateOption = None,
    reasoning_budget: c.ReasoningBudget = None,
    allowed_hosts: AllowedHosts = None,
    max_connections: MaxConnections = 4096,
    header_timeout: HeaderTimeout = 10.0,
    body_timeout: BodyTimeout = 60.0,
    max_body_mb: MaxBodyMb = 4.0,
    webui: WebUI = True,
    metrics_public: MetricsPublic = False,
    drain_timeout: DrainTimeout = 30.0,
    kv_events_config: KvEventsConfig = None,
    alias: Alias = None,
    log_level: LogLevel = "info",
) -> None:
    """Serve MODEL (or several, each loaded on demand) over an OpenAI-compatible HTTP API on 127.0.0.1
    (--host to change): OpenAI's /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses,
    /v1/models, Anthropic's /v1/messages, /tokenize, /detokenize, /health, /ready, /metrics,
    POST /admin/drain and a chat page at / (--no-webui). SIGTERM drains (--drain-timeout).

    Examples:

      localllm serve smollm2-135m-instruct --port 8000 --parallel 4

      LOCALLLM_API_KEY=secret localllm serve model.gguf --host 0.0.0.0 --cors-origins '*'

      localllm serve smollm2-135m-instruct gemma-3-270m --keep-alive 10m --max-loaded 1

      curl localhost:8080/v1/completions -d '{"prompt": "Once upon a time", "max_tokens": 32}'

    /v1/completions stops at 16 tokens without max_tokens (OpenAI's default); chat runs to the context.
    """
    _serve_command(SimpleNamespace(**locals()))


def _serve_command(o: SimpleNamespace) -> None:
    from localllm.cli.serve_models import check_single_model_flags, model_names, served_models
    from localllm.server.connections import ConnectionLimits

    check_values(vars(o))
    pool_limits = _pool_limits(o)
    limits = ConnectionLimits(o.max_connections, o.header_timeout, o.body_timeout)
    names = model_names(o.models, o.models_dir)
    flags = {"--alias": o.alias, "--chat-template": o.chat_template, "--draft-model": o.draft_model,
             "--kv-events-config": o.kv_events_config}  # fmt: skip
    check_single_model_flags(len(names), flags)
    spec = c.spec_options(o.prompt_lookup, o.draft_model, o.draft_max, o.draft_vocab)
    spec |= c.kv_disk_options(o.kv_disk_mb, o.kv_disk_dir, default_on=True)

    def resolve(name: str | None) -> tuple[Path, dict[str, Any], Any]:
        path, defaults = c.resolve(name, o.backend, o.threads, (o.cache_type_k, o.cache_type_v))
        engine_config = c.engine_config(
            path, o.backend, o.threads, o.ctx_size, defaults, max_num_seqs=o.parallel,
            kv_cache_mb=o.kv_cache_mb, cache_type_k=o.cache_type_k, cache_type_v=o.cache_type_v,
            device=o.device, **spec,
        )  # fmt: skip
        return path, defaults, engine_config

    if len(names) == 1:
        _serve_one(o, names[0], resolve, limits)
        return
    base = _server_config(o, names[0] or "default", (), None)
    models = served_models(names, resolve, base, served_id)
    c.first_run_notice(o.backend)
    run_server(None, base, o.log_level, limits, models, pool_limits)


def _serve_one(o: SimpleNamespace, name: str | None, resolve: Any, limits: Any) -> None:
    """One model, loaded as the server starts (a failed load ends the server)."""
    from localllm.engine.engine import LLMEngine
    from localllm.tokenizer.chat_template import chat_template_source

    path, defaults, engine_config = resolve(name)
    template = chat_template_source(o.chat_template, defaults.get("chat_template"))
    config = _server_config(
        o, served_id(name, path), (path.name, path.stem, *([name] if name else [])), template
    )
    c.first_run_notice(o.backend)
    publisher = kv_event_publisher(o.kv_events_config)
    run_server(with_kv_events(lambda: LLMEngine(engine_config), publisher), config, o.log_level, limits)


def _server_config(o: SimpleNamespace, model_id: str, aliases: tuple[str, ...], template: str | None) -> Any:
    from localllm.server.state import ServerConfig

    return ServerConfig(
        model_id=model_id,
        model_aliases=tuple(set(aliases)),
        served_aliases=_split(o.alias),
        api_key=o.api_key or None,
        cors_origins=_split(o.cors_origins),
        allowed_hosts=_split(o.allowed_hosts),
        max_body_bytes=int(o.max_body_mb * 2**20),
        max_queue=o.max_queue,
        max_embedding_tokens=o.max_embedding_tokens,
        max_choice_tokens=o.max_choice_tokens,
        chat_template=template,
        reasoning_budget=o.reasoning_budget,
        host=o.host,
        port=o.port,
        webui=o.webui,
        metrics_public=o.metrics_public,
        drain_timeout=o.drain_timeout,
    )


def _pool_limits(o: SimpleNamespace) -> Any:
    from localllm.server.model_pool import PoolLimits, parse_keep_alive

    try:
        keep_alive = parse_keep_alive(o.keep_alive)
    except ValueError as e:
        _usage_error(f"--keep-alive: {e}")
    return PoolLimits(keep_alive, o.max_loaded, o.max_memory_mb * 2**20, o.load_timeout)


def kv_event_publisher(text: str | None) -> Any:
    """The KV-event publisher --kv-events-config asks for (its socket bound now, so a taken port is a
    usage error before the model loads), or None; a bad value or a missing extra is one line."""
    from localllm.engine import kv_events

    if not text:
        return None
    try:
        config = kv_events.KVEventsConfig.parse(text)
    except (ValueError, TypeError) as e:
        _usage_error(str(e))
    if not config.enabled:
        return None
    missing = kv_events.missing_dependencies()
    if missing:
        _usage_error(missing)
    try:
        return kv_events.KVEventPublisher(config)
    except Exception as e:  # zmq.ZMQError: address in use, bad endpoint
        _usage_error(f"--kv-events-config: cannot open {config.endpoint}: {e}")


def with_kv_events(factory: Any, publisher: Any) -> Any:
    """`factory`, its engine's block manager wired to `publisher` (kv_events.attach) when there is one."""
    if publisher is None:
        return factory

    def make() -> Any:
        from localllm.engine import kv_events

        engine = factory()
        kv_events.attach(engine.block_manager, publisher)
        return engine

    return make


# flag -> (lowest allowed, highest allowed or None, what the range means)
RANGES: dict[str, tuple[float, float | None, str]] = {
    "port": (1, 65535, "between 1 and 65535"),
    "parallel": (1, None, "at least 1"),
    "ctx_size": (0, None, "0 (the model's) or more"),
    "kv_cache_mb": (0, None, "0 (automatic) or more"),
    "threads": (0, None, "0 (physical cores) or more"),
    "max_queue": (0, None, "0 (unbounded) or more"),
    "max_embedding_tokens": (1, None, "at least 1"),
    "max_choice_tokens": (1, None, "at least 1"),
    "max_connections": (1, None, "at least 1"),
    "header_timeout": (0.1, None, "at least 0.1 s"),
    "body_timeout": (0.1, None, "at least 0.1 s"),
    "max_body_mb": (0.001, None, "at least 0.001"),
    "drain_timeout": (0, None, "0 (at once) or more seconds"),
    "max_loaded": (0, None, "0 (no limit) or more"),
    "max_memory_mb": (0, None, "0 (no budget) or more"),
    "load_timeout": (0.1, None, "at least 0.1 s"),
}


def check_values(values: dict[str, Any]) -> None:
    """A value out of range is one line on stderr and exit status 2 (a usage error), no traceback."""
    for name, (low, high, meaning) in RANGES.items():
        value = values[name]
        if value != value or value < low or (high is not None and value > high):  # value != value: NaN
            _usage_error(f"--{name.replace('_', '-')} must be {meaning}, not {value}")
    if values["log_level"].lower() not in LOG_LEVELS:
        _usage_error(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {values['log_level']}")


def _usage_error(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _split(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for value in values or [] for v in value.split(",") if v.strip())


def served_id(model: str | None, path: Path) -> str:
    """The registry name when MODEL is (or defaults to) a registry entry, else the file stem."""
    from localllm.registry import default_user_registry, load_registry

    registry = load_registry(default_user_registry())
    entry = registry.find(model or registry.default_model)
    return entry.name if entry is not None and entry.file_name == path.name else path.stem


def run_server(
    factory: Any, config: Any, log_level: str = "info", limits: Any = None, models: Any = (), pool: Any = None
) -> None:
    """Run until SIGINT (open streams end with an error event, then the engine stops) or SIGTERM (a
    drain: open requests finish first, see localllm.server.runner); exits with an error if the model
    fails to load. With `models` (several, within `pool`'s limits), each loads on demand instead."""
    from localllm.errors import LocalLLMError
    from localllm.server.app import create_app
    from localllm.server.connections import ConnectionLimits, raise_open_file_limit, usable_connections
    from localllm.server.runner import log_config, make_server

    failures: list[BaseException] = []
    server: Any = None

    def on_load_error(error: BaseException) -> None:
        failures.append(error)
        if server is not None:
            server.should_exit = True

    limits = limits or ConnectionLimits()
    # More descriptors than connections, so the limit (not EMFILE) is what a flood of sockets meets.
    usable = usable_connections(limits.max_connections, raise_open_file_limit())
    limits = dataclasses.replace(limits, max_connections=usable)
    app_ = create_app(factory, dataclasses.replace(config, on_load_error=on_load_error), models, pool)
    server = make_server(app_, config.host, config.port, limits, log_level, log_config(log_level))
    server.run()
    if failures:
        raise LocalLLMError(f"the model failed to load: {failures[0]}")
