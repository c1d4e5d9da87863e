"""`localllm bench serve`: a load generator for any OpenAI-compatible server, with vLLM's metric set.

Requests go to /v1/completions with `stream: true` and `stream_options.include_usage`, so token counts
come from the server's own usage chunk (chunks are counted only when a server sends no usage). Load is
`concurrency` client slots fed by Poisson arrivals at `request_rate` (inf = all at once, which makes it a
closed loop: each slot sends its next request when the last one finishes). Prompts are random common
English words, scaled by a tokens-per-word ratio measured with one probe request, so the same workload
means roughly the same token counts on any server and tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localllm.errors import LocalLLMError

WORDS = (
    "the be to of and a in that have it for not on with he as you do at this but his by from they we say "
    "her she or an will my one all would there their what so up out if about who get which go me when make "
    "can like time no just him know take people into year your good some could them see other than then now "
    "look only come its over think also back after use two how our work first well way even new want because "
    "any these give day most us is was are were been has had did said made went found long down side been "
    "call water word number sound place little very thing great help through much before line right too mean "
    "old same tell boy follow came show around form three small set put end does another large must big high "
    "such turn here why ask men change light kind off need house picture try again animal point mother world "
    "near build self earth father head stand own page should country answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross farm hard start "
    "might story saw far sea draw left late run while press close night real life few north open seem"
).split()
PROBE_WORDS = 16  # words in the short probe; the long one has twice as many


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int
    input_len: int  # planned prompt tokens (0 = unknown); the server's usage gives the true count


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first token
    e2e: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between successive token chunks
    start: float = 0.0  # seconds after the level started
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for one-token answers."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ------------------------------------------------------------------------------------------------ workload


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], as vLLM's random dataset draws them."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _text(rng: np.random.Generator, tokens: int, tokens_per_word: float) -> str:
    n_words = max(1, round(tokens / tokens_per_word))
    return " ".join(rng.choice(WORDS, size=n_words).tolist())


def synthetic_workload(
    n: int,
    input_len: int,
    output_len: int,
    ratio: float,
    tokens_per_word: float,
    prefix_len: int = 0,
    seed: int = 0,
    level: int = 0,
) -> list[RequestSpec]:
    """Random-word prompts; with prefix_len, every prompt starts with the same prefix_len tokens of text
    (a shared system prompt, say) so a prefix cache can skip them. Lengths depend on `seed` only; the
    words also on `level`, so each concurrency level gets fresh text and no cache hits from the last."""
    rng, words = np.random.default_rng(seed), np.random.default_rng([seed, level])
    ins, outs = _lengths(rng, n, input_len, ratio), _lengths(rng, n, output_len, ratio)
    prefix = _text(words, prefix_len, tokens_per_word) + " " if prefix_len else ""
    return [
        RequestSpec(prefix + _text(words, i, tokens_per_word), o, prefix_len + i)
        for i, o in zip(ins, outs, strict=True)
    ]


def jsonl_workload(path: Path, n: int, output_len: int) -> list[RequestSpec]:
    """Lines of {"prompt": ..., "max_tokens": optional}; cycled when n exceeds the file."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rows.append(RequestSpec(str(obj["prompt"]), int(obj.get("max_tokens") or output_len), 0))
        except (ValueError, KeyError, TypeError) as e:
            raise LocalLLMError(f"{path}:{number}: expected a JSON object with 'prompt' ({e})") from None
    if not rows:
        raise LocalLLMError(f"{path} holds no prompts")
    return [rows[i % len(rows)] for i in range(n)]


# ------------------------------------------------------------------------------------------------ client


def base_url(url: str) -> str:
    """The server root, whether given as http://host:port or http://host:port/v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def model_name(base: str, headers: dict[str, str], fallback: str) -> str:
    """The first model the server lists (vLLM checks the field; llama-server ignores it)."""
    import httpx

    try:
        data = httpx.get(f"{base}/v1/models", headers=headers, timeout=10).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return fallback


SPEC_METRICS = {
    "localllm:spec_decode_num_draft_tokens_total": "drafted_tokens",
    "localllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


def spec_counts(base: str, headers: dict[str, str]) -> dict[str, float] | None:
    """Speculative decoding's counts from a localllm server's /metrics (None: no speculation, or another
    server), with the acceptance rate."""
    import httpx

    try:
        text = httpx.get(f"{base}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    counts = {}
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        name = sample.partition("{")[0]  # samples carry a model_name label; a server serves one model
        if name in SPEC_METRICS:
            counts[SPEC_METRICS[name]] = float(value)
    if len(counts) < len(SPEC_METRICS):
        return None
    drafted = counts["drafted_tokens"]
    counts["acceptance_rate"] = counts["accepted_tokens"] / drafted if drafted else 0.0
    return counts


def prompt_tokens(base: str, model: str, headers: dict[str, str], prompt: str) -> int | None:
    """The server's count of prompt tokens for `prompt`, from a max_tokens=1 request; None if unknown."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": False}
    try:
        resp = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=600)
        return int(resp.json()["usage"]["prompt_tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def tokens_per_word(base: str, model: str, headers: dict[str, str]) -> float | None:
    """Prompt tokens per word of our text on this server's tokenizer: the slope between two short probes,
    so a BOS token or template overhead does not count, and short enough for any context. The probes
    also warm the server up. None when the server answers without usage."""
    sample = np.random.default_rng(0).choice(WORDS, size=2 * PROBE_WORDS).tolist()
    words = [" ".join(sample[:PROBE_WORDS]), " ".join(sample)]
    short, long = (prompt_tokens(base, model, headers, w) for w in words)
    if short is None or long is None or long <= short:
        return short / PROBE_WORDS if short else None
    return (long - short) / PROBE_WORDS


def payload(spec: RequestSpec, model: str, ignore_eos: bool) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # llama-server, vLLM and localllm honour it, so output lengths match the workload
        body["ignore_eos"] = True
    return body


async def send_request(client: Any, url: str, body: dict[str, Any]) -> RequestResult:
    """One streamed completion; any failure (status, dropped connection, error event) is a failed result."""
    import httpx

    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(False, error=f"HTTP {resp.status_code}: {text}")
            return await _read_stream(resp, start)
    except (httpx.HTTPError, OSError, ValueError) as e:
        return RequestResult(False, e2e=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")


async def _read_stream(resp: Any, start: float) -> RequestResult:
    result, usage, done, last = RequestResult(True), None, False, start
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return RequestResult(False, error=f"stream error: {chunk['error']}")
        usage = chunk.get("usage") or usage
        if _is_token_chunk(chunk):
            now = time.perf_counter()
            result.ttft = result.ttft or now - start
            if chunks:
                result.itl.append(now - last)
            chunks, last = chunks + 1, now
    if not done:
        return RequestResult(False, error="the stream ended without [DONE]")
    result.e2e = time.perf_counter() - start
    _apply_usage(result, usage, chunks)
    return result


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk that carries generated text; the final empty one with only finish_reason does not."""
    choices = chunk.get("choices") or []
    return bool(choices) and bool(choices[0].get("text") or choices[0].get("finish_reason") is None)


def _apply_usage(result: RequestResult, usage: dict[str, Any] | None, chunks: int) -> None:
    usage = usage or {}
    result.output_tokens = int(usage.get("completion_tokens") or chunks)
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# ------------------------------------------------------------------------------------------------ load


@dataclass
class LoadConfig:
    url: str  # server root
    model: str  # the request's model field
    concurrency: list[int]
    request_rate: float = math.inf
    ignore_eos: bool = True
    timeout: float = 600.0
    api_key: str | None = None
    seed: int = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def run_level(
    config: LoadConfig, bodies: list[dict[str, Any]], concurrency: int, on_done: Any = None
) -> tuple[list[RequestResult], float]:
    """Send every body with at most `concurrency` in flight; returns results in order and the duration."""
    import httpx

    rng = np.random.default_rng(config.seed)
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(config.timeout, connect=10)
    url = f"{config.url}/v1/completions"
    async with httpx.AsyncClient(headers=config.headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def one(body: dict[str, Any]) -> RequestResult:
            async with slots:
                started = time.perf_counter() - t0
                result = await send_request(client, url, body)
            result.start = started
            if on_done is not None:
                on_done(result)
            return result

        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if math.isfinite(config.request_rate) and config.request_rate > 0:
                await asyncio.sleep(rng.exponential(1.0 / config.request_rate))  # Poisson arrivals
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ metrics


def stats_ms(values: list[float]) -> dict[str, float]:
    """mean / std / median / p90 / p99 in milliseconds (zeros when nothing was measured, as vLLM does)."""
    if not values:
        return {"mean": 0.0, "std": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ms = np.asarray(values, dtype=np.float64) * 1000
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "mean": float(ms.mean()),
        "std": float(ms.std()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
    }


def compute_metrics(
    results: list[RequestResult], duration: float, specs: list[RequestSpec]
) -> dict[str, Any]:
    """vLLM's serving metrics over the successful requests; failures are counted and their errors kept."""
    ok = [r for r in results if r.ok]
    for r, spec in zip(results, specs, strict=True):
        if r.ok and not r.prompt_tokens:
            r.prompt_tokens = spec.input_len  # no usage from the server: fall back to the planned length
    prompt, output = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "cached_tokens": cached,
        "cached_token_ratio": cached / prompt if prompt else 0.0,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2el_ms": stats_ms([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }


def run_sweep(
    config: LoadConfig, workload: Callable[[int], list[RequestSpec]], progress: bool = True
) -> list[dict[str, Any]]:
    """One level per concurrency, each with `workload(level index)`: its metrics and its per-request
    records (for CDFs and checks)."""
    levels = []
    for index, conc in enumerate(config.concurrency):
        specs = workload(index)
        bodies = [payload(s, config.model, config.ignore_eos) for s in specs]
        with _progress(progress, len(specs), f"concurrency {conc}") as advance:
            results, duration = asyncio.run(run_level(config, bodies, conc, advance))
        metrics = compute_metrics(results, duration, specs)
        record = {"concurrency": conc, "request_rate": json_rate(config.request_rate), **metrics}
        levels.append({**record, "requests": [_record(r) for r in results]})
    return levels


def json_rate(rate: float) -> float | str:
    """JSON has no Infinity (Python writes one, jq and browsers reject it): "inf" stands in."""
    return rate if math.isfinite(rate) else "inf"


def _record(r: RequestResult) -> dict[str, Any]:
    record = asdict(r)
    record.pop("itl")  # per-token gaps would dwarf the file; their summary is in itl_ms
    record["tpot"] = r.tpot
    return record


@contextmanager
def _progress(enabled: bool, total: int, label: str) -> Iterator[Any]:
    """A Rich progress bar on stderr, advanced once per finished request (failures in red in the label)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=total)
        failed = 0

        def advance(result: RequestResult) -> None:
            nonlocal failed
            failed += not result.ok
            suffix = f" [red]{failed} failed[/]" if failed else ""
            bar.update(task, advance=1, description=label + suffix)

        yield advance


# ------------------------------------------------------------------------------------------------ report

ROWS = [
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "failed", "{:d}"),
    ("Benchmark duration (s)", "duration_s", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
    ("Cached prompt tokens", "cached_tokens", "{:d}"),
    ("Cached-token ratio", "cached_token_ratio", "{:.1%}"),
]
LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2el_ms")]


def print_serving(levels: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """vLLM's result block as one Rich table, a column per concurrency level."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Serving benchmark: {info.get('target', '')}", caption=system_caption(info))
    table.add_column("metric")
    for level in levels:
        table.add_column(f"concurrency {level['concurrency']}", justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, *(fmt.format(level[key]) for level in levels))
    for name, key in LATENCIES:
        table.add_section()
        for stat in ("mean", "median", "p90", "p99"):
            table.add_row(f"{stat.capitalize()} {name} (ms)", *(f"{lv[key][stat]:.2f}" for lv in levels))
    console = Console()
    console.print(table)
    if spec := info.get("speculative"):
        console.print(
            f"speculative decoding: drafted {spec['drafted_tokens']:.0f}, accepted "
            f"{spec['accepted_tokens']:.0f} ({100 * spec['acceptance_rate']:.0f}%)"
        )
    for level in levels:
        for error in level["errors"]:
            console.print(f"[red]concurrency {level['concurrency']}: {error}[/]")


def system_caption(info: dict[str, Any]) -> str:
    """One line saying what the numbers were measured on."""
    model = f"; model sha256 {info['model_sha256'][:12]}" if info.get("model_sha256") else ""
    return (
        f"{info.get('cpu', '?')}, {info.get('physical_cores', '?')} cores, "
        f"{info.get('threads', '?')} threads, "
        f"backend {info.get('backend', '?')}; localllm {info.get('localllm_version', '?')} "
        f"({info.get('git_revision', '?')}), {info.get('date', '?')}{model}"
    )
