"""Prometheus metrics under vLLM's names, plus the one log line per request.

Every family is exposed twice, as `localllm:NAME` and as vLLM's `vllm:NAME`, each sample labelled with
`model_name`, so routers and dashboards built for vLLM workers read a localllm worker unchanged.
Each app owns its CollectorRegistry (not the process-global one), so tests can build several apps.
Engine state (queue lengths, KV usage, prefix-cache counts: LLMEngine.stats()) is read at scrape time;
per-request counters and histograms are fed by `RequestTracker` as outputs stream past.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from localllm.engine.engine import EngineStats
    from localllm.engine.output import StepOutput

log = logging.getLogger("localllm.server")

# vLLM's bucket edges, so dashboards built for vLLM read these the same way.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _EngineCollector(Collector):
    """Gauges and counters mirrored from the engine's stats when Prometheus scrapes (nothing while
    loading)."""

    def __init__(self, get_stats: Callable[[], EngineStats | None]):
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        yield GaugeMetricFamily(
            "localllm:num_requests_running", "Requests in the running batch.", stats.num_running
        )
        yield GaugeMetricFamily(
            "localllm:num_requests_waiting", "Requests waiting to start.", stats.num_waiting
        )
        yield GaugeMetricFamily(
            "localllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", stats.kv_cache_usage
        )
        yield CounterMetricFamily(
            "localllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "localllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield CounterMetricFamily(
            "localllm:num_preemptions", "Sequences preempted for lack of KV blocks.", stats.num_preemptions
        )
        if stats.spec is not None:
            yield from _spec_metrics(stats.spec)
        if stats.kv_disk is not None:
            yield from _disk_metrics(stats.kv_disk)


def _disk_metrics(stats) -> Iterator[Metric]:
    """The prefix cache's disk tier (engine/kv_disk.py), in blocks, and the bytes its files hold."""
    for name, value, doc in (
        ("hits", stats.hits, "KV blocks restored from disk."),
        ("writes", stats.writes, "KV blocks written to disk."),
        ("dropped", stats.dropped, "KV blocks not written: the write queue was full."),
        ("bad_files", stats.bad, "KV block files that failed a check (deleted, recomputed)."),
        ("evictions", stats.evicted, "KV block files deleted to stay within the disk budget."),
    ):
        yield CounterMetricFamily(f"localllm:kv_disk_{name}", doc, value)


def _spec_metrics(stats) -> Iterator[Metric]:
    """Speculative decoding's counts, by vLLM's spec_decode names."""
    yield CounterMetricFamily(
        "localllm:spec_decode_num_draft_tokens", "Drafted tokens verified.", stats.drafted_tokens
    )
    yield CounterMetricFamily(
        "localllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", stats.accepted_tokens
    )
    yield CounterMetricFamily(
        "localllm:spec_decode_num_drafts", "Verify steps of one sequence.", stats.verify_steps
    )
    yield GaugeMetricFamily(
        "localllm:spec_decode_draft_acceptance_rate",
        "Accepted over drafted tokens since start (0-1).",
        stats.acceptance_rate,
    )


PREFIXES = ("localllm:", "vllm:")


class _Dialects(Collector):
    """Every family of `inner` (named `localllm:...`) under each of PREFIXES, with a model_name label."""

    def __init__(self, inner: CollectorRegistry, model_name: str):
        self.inner = inner
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            for prefix in PREFIXES:
                yield relabelled(family, prefix, self.model_name)


def relabelled(family: Metric, prefix: str, model_name: str) -> Metric:
    """`family` renamed from localllm: to `prefix`, each sample labelled model_name."""
    out = Metric(
        prefix + family.name.removeprefix(PREFIXES[0]), family.documentation, family.type, family.unit
    )
    out.samples = [
        s._replace(
            name=prefix + s.name.removeprefix(PREFIXES[0]), labels={**s.labels, "model_name": model_name}
        )
        for s in family.samples
    ]
    return out


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


PoolSample = tuple[str, str, str, dict[str, str], float]  # name (no prefix), type, help, labels, value


def merged_exposition(registries: list[CollectorRegistry], extra: list[PoolSample]) -> tuple[bytes, str]:
    """Several models' metrics as one scrape: each family once, holding every model's samples (each
    labelled with its model_name), and `extra` (the model pool's own) under both prefixes."""
    families: dict[str, Metric] = {}
    for registry in registries:
        for family in registry.collect():
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            merged.samples.extend(family.samples)
    for name, kind, doc, labels, value in extra:
        for prefix in PREFIXES:
            family = families.setdefault(prefix + name, Metric(prefix + name, doc, kind))
            family.add_sample(prefix + name + ("_total" if kind == "counter" else ""), labels, value)
    out = CollectorRegistry(auto_describe=False)
    out.register(_Families(list(families.values())))
    return generate_latest(out), CONTENT_TYPE_LATEST


class ServerMetrics:
    """The request counters and histograms, and the engine's stats read through `get_stats` (None
    while the model loads) at each scrape, exposed under both names (`_Dialects`)."""

    def __init__(self, get_stats: Callable[[], EngineStats | None], model_name: str = "default"):
        self.registry = CollectorRegistry()  # what is recorded, as localllm:...
        self.exposed = CollectorRegistry()  # what a scrape reads: both dialects, labelled
        self.exposed.register(_Dialects(self.registry, model_name))
        r = self.registry
        self.prompt_tokens = Counter("localllm:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("localllm:generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            "localllm:request_success", "Finished requests.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "localllm:time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "localllm:inter_token_latency_seconds", "Time between tokens.", buckets=ITL_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "localllm:time_per_output_token_seconds",
            "Time per output token after the first, per request.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "localllm:e2e_request_latency_seconds", "Request latency.", buckets=E2E_BUCKETS, registry=r
        )
        r.register(_EngineCollector(get_stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.exposed), CONTENT_TYPE_LATEST

    def record_finished(self, last: StepOutput, reason: str) -> None:
        self.prompt_tokens.inc(last.prompt_tokens)
        self.generation_tokens.inc(last.generated_tokens)
        self.request_success.labels(finished_reason=reason).inc()
        if last.ttft is not None:
            self.ttft.observe(last.ttft)
            if last.generated_tokens > 1:
                self.tpot.observe(max(last.elapsed - last.ttft, 0.0) / (last.generated_tokens - 1))
        self.e2e.observe(last.elapsed)


class RequestTracker:
    """Feeds one request's outputs into the metrics and logs a line when it ends (finished or aborted)."""

    def __init__(self, metrics: ServerMetrics, request_id: str):
        self.metrics = metrics
        self.request_id = request_id
        self.last: StepOutput | None = None
        self.done = False

    def observe(self, out: StepOutput) -> None:
        # StepOutput.elapsed is stamped by the engine at the step, so differences are true token gaps.
        if self.last is not None and out.token_id is not None and self.last.token_id is not None:
            self.metrics.itl.observe(max(out.elapsed - self.last.elapsed, 0.0))
        self.last = out
        if out.finished:
            self._end(out.finish_reason or "stop")

    def aborted(self) -> None:
        if self.done:
            return
        if self.last is not None:
            self._end("abort")
            return
        self.done = True  # gone before its first token: counted, nothing else to report
        self.metrics.request_success.labels(finished_reason="abort").inc()
        log.info("%s: aborted before its first token", self.request_id)

    def _end(self, reason: str) -> None:
        self.done = True
        last = self.last
        assert last is not None
        self.metrics.record_finished(last, reason)
        log.info("%s", request_summary(self.request_id, last, reason))


def request_summary(request_id: str, out: StepOutput, reason: str) -> str:
    ttft = out.ttft or 0.0
    decode_time = out.elapsed - ttft
    rate = (out.generated_tokens - 1) / decode_time if out.generated_tokens > 1 and decode_time > 0 else 0.0
    return (
        f"{request_id}: prompt {out.prompt_tokens} tokens ({out.cached_tokens} cached), "
        f"generated {out.generated_tokens} tokens, TTFT {ttft * 1000:.0f} ms, {rate:.1f} tok/s, "
        f"total {out.elapsed:.2f} s, finish {reason}"
    )
