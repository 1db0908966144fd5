"""Prometheus metrics: latency histograms observed per request, engine gauges and counters read at scrape time.

Engine-owned numbers (running/waiting, KV pages, token counters) come from `engine.stats()` when scraped, so
there is one source of truth and nothing to keep in sync on the hot path.

Every family vLLM's dashboards read is also exported under vLLM's name (`vllm:...`, label `model_name`),
copied from Hearth's at scrape time (`_VllmNames`): nothing is observed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hearth_"
_TTFT_BUCKETS_S = (
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
    40.0,
)
_ITL_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.5,
)
_E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
# vLLM's request phase buckets (queue, prefill, decode, inference).
_PHASE_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)  # fmt: skip


def _tokens_buckets(max_tokens: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to the context length: 1, 2, 5, 10, 20, 50, ..."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_tokens:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


VLLM_PREFIX = "vllm:"
# Hearth's family name (no prefix) -> vLLM's names for the same numbers.
_VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "num_preemptions": ("num_preemptions",),
    "prefix_cache_queries_tokens": ("prefix_cache_queries",),
    "prefix_cache_hit_tokens": ("prefix_cache_hits",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_time_per_output_token_seconds": ("request_time_per_output_token_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prefill_time_seconds": ("request_prefill_time_seconds",),
    "request_decode_time_seconds": ("request_decode_time_seconds",),
    "request_inference_time_seconds": ("request_inference_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "request_max_num_generation_tokens": ("request_max_num_generation_tokens",),
    "request_params_max_tokens": ("request_params_max_tokens",),
    "request_params_n": ("request_params_n",),
    "requests": ("request_success",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
}
_VLLM_LABELS = {"finish_reason": "finished_reason"}


class _VllmNames(Collector):
    """Hearth's families, then the ones vLLM's dashboards read again under vLLM's names and labels."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            yield family
            short = family.name.removeprefix(PREFIX)
            for vllm_name in _VLLM_NAMES.get(short, ()) if family.name.startswith(PREFIX) else ():
                renamed = Metric(VLLM_PREFIX + vllm_name, family.documentation, family.type)
                old_base, new_base = family.name, VLLM_PREFIX + vllm_name
                renamed.samples = [
                    sample._replace(
                        name=new_base + sample.name[len(old_base) :],
                        labels={_VLLM_LABELS.get(key, key): value for key, value in sample.labels.items()},
                    )
                    for sample in family.samples
                ]
                yield renamed


class _EngineCollector(Collector):
    def __init__(self, stats_fn: Callable[[], Any | None], model_name: str) -> None:
        self._stats_fn = stats_fn
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        if stats is None:  # still loading
            return
        labels = ["model_name"]
        value = [self._model_name]

        def gauge(name: str, doc: str, number: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(value, number)
            return family

        def counter(name: str, doc: str, number: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(value, number)
            return family

        yield gauge("num_requests_running", "Requests the engine is running.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting for the engine.", stats.num_waiting)
        yield gauge("kv_pages_used", "KV cache pages in use.", stats.kv_pages_used)
        total_pages = stats.kv_pages_total
        yield gauge(
            "kv_cache_usage_perc",
            "KV cache usage: pages in use / pages in all (0-1).",
            stats.kv_pages_used / total_pages if total_pages else 0.0,
        )
        yield counter(
            "num_preemptions",
            "Requests preempted (their KV freed, to be recomputed) to make room.",
            getattr(stats, "num_preemptions_total", 0),
        )
        yield gauge("kv_pages_total", "KV cache pages in all.", stats.kv_pages_total)
        yield gauge(
            "kv_cache_tokens", "Tokens the KV cache holds in all (pages x page size).", stats.kv_tokens_total
        )
        queries = stats.prefix_cache_queries_tokens
        hit_ratio = stats.prefix_cache_hit_tokens / queries if queries else 0.0
        yield gauge(
            "prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / looked up.", hit_ratio
        )
        yield counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_cache_hit_tokens,
        )
        yield counter("prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens_total)
        yield counter(
            "cached_tokens", "Prompt tokens served from the prefix cache.", stats.cached_tokens_total
        )
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter(
            "kv_integrity_failures",
            "Request-steps whose KV page tables failed the integrity check (each recomputed or failed).",
            stats.kv_integrity_failures_total,
        )
        yield counter(
            "kv_transfer_failures",
            "PD KV transfers that failed here (a decode server recomputes the prompt instead).",
            stats.kv_transfer_failures_total,
        )
        yield counter(
            "kv_recomputed_tokens",
            "Prompt tokens whose KV was promised by a peer or a tier but was recomputed.",
            stats.kv_recomputed_tokens_total,
        )
        yield counter(
            "kv_transfer_pages", "KV pages sent or received by PD transfer.", stats.kv_transfer_pages_total
        )
        if getattr(stats, "spec_method", ""):
            yield from _speculative_metrics(stats, self._model_name)
        yield from _tier_metrics(getattr(stats, "kv_tiers", None) or [], self._model_name)
        yield from _retention_metrics(stats, gauge, counter)


def _retention_metrics(stats: Any, gauge: Any, counter: Any) -> Iterator[Metric]:
    """Tool-pause retention (hearth.engine.retention): what sessions hold between turns, and why holds end."""
    yield gauge("kv_retained_pages", "KV pages held for agent sessions between turns.", stats.retained_pages)
    yield gauge("kv_retained_sessions", "Agent sessions whose pages are held.", stats.retained_sessions)
    for reason, number in (
        ("expired", stats.retention_expired_total),
        ("evicted", stats.retention_evicted_total),
        ("replaced", stats.retention_replaced_total),
        ("yielded", stats.retention_yielded_total),
    ):
        yield counter(f"kv_retention_{reason}", f"Session holds released: {reason}.", number)


def _speculative_metrics(stats: Any, model_name: str) -> Iterator[Metric]:
    """Per method: drafts proposed and accepted, acceptance rate, mean accepted length (tokens per verified
    row: accepted drafts + the one sampled after them)."""
    labels, value = ["model_name", "method"], [model_name, stats.spec_method]
    numbers = [
        (
            "spec_decode_num_drafts",
            "Verified rows that carried draft tokens.",
            stats.spec_num_drafts_total,
            True,
        ),
        (
            "spec_decode_num_draft_tokens",
            "Draft tokens proposed and verified.",
            stats.spec_draft_tokens_total,
            True,
        ),
        (
            "spec_decode_num_accepted_tokens",
            "Draft tokens the target accepted.",
            stats.spec_accepted_tokens_total,
            True,
        ),
    ]
    drafts, proposed = stats.spec_num_drafts_total, stats.spec_draft_tokens_total
    accepted = stats.spec_accepted_tokens_total
    numbers.append(
        (
            "spec_decode_acceptance_rate",
            "Accepted / proposed draft tokens.",
            accepted / proposed if proposed else 0.0,
            False,
        )
    )
    numbers.append(
        (
            "spec_decode_mean_accepted_length",
            "Tokens per verified row: 1 + accepted drafts per row.",
            1.0 + accepted / drafts if drafts else 0.0,
            False,
        )
    )
    for name, doc, number, is_counter in numbers:
        family_cls = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = family_cls(PREFIX + name, doc, labels=labels)
        family.add_metric(value, number)
        yield family


_TIER_COUNTERS = (
    ("lookup_pages", "Pages asked of the tier on a device-cache miss."),
    ("lookup_hit_pages", "Pages the tier said it holds."),
    ("hit_pages", "Pages loaded from the tier into the device cache."),
    ("hit_bytes", "Bytes loaded from the tier."),
    ("written_pages", "Pages written to the tier."),
    ("written_bytes", "Bytes written to the tier."),
    ("dropped_writes", "Page writes dropped (queue full or tier down)."),
    ("failed_writes", "Page writes that failed."),
    ("failed_reads", "Loads that failed (tier unreachable)."),
    ("invalid_pages", "Pages read back and rejected (damaged, wrong layout or key)."),
)


def _tier_metrics(tiers: list[Any], model_name: str) -> Iterator[Metric]:
    """Per KV tier (host, disk, redis, mooncake): traffic counters, size gauges, latency histograms."""
    if not tiers:
        return
    from hearth.kv.tiers.stats import LATENCY_BUCKETS_S

    labels = ["model_name", "tier"]
    for name, doc in _TIER_COUNTERS:
        family = CounterMetricFamily(PREFIX + "kv_tier_" + name, doc, labels=labels)
        for tier in tiers:
            family.add_metric([model_name, tier.name], getattr(tier, name))
        yield family
    for name, doc in (("stored_pages", "Pages this server knows the tier holds (-1: a shared store)."),
                      ("stored_bytes", "Bytes this server knows the tier holds (-1: a shared store).")):  # fmt: skip
        family = GaugeMetricFamily(PREFIX + "kv_tier_" + name, doc, labels=labels)
        for tier in tiers:
            family.add_metric([model_name, tier.name], getattr(tier, name))
        yield family
    for name, doc in (("read_latency", "Time to load a batch of pages from the tier."),
                      ("write_latency", "Time to write a batch of pages to the tier.")):  # fmt: skip
        family = HistogramMetricFamily(PREFIX + f"kv_tier_{name}_seconds", doc, labels=labels)
        for tier in tiers:
            histogram = getattr(tier, name)
            cumulative, buckets = 0, []
            for bound, count in zip([*LATENCY_BUCKETS_S, float("inf")], histogram.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([model_name, tier.name], buckets, histogram.sum_s)
        yield family


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(
        self, model_name: str, stats_fn: Callable[[], Any | None], max_model_len: int = 1 << 17
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._exposition = CollectorRegistry(auto_describe=False)
        self._exposition.register(_VllmNames(self.registry))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.queue_time_s = histogram(
            "request_queue_time_seconds",
            "Time a request waited in the engine before it first ran.",
            _PHASE_BUCKETS_S,
        )
        self.prefill_time_s = histogram(
            "request_prefill_time_seconds", "Time from first running to the first token.", _PHASE_BUCKETS_S
        )
        self.decode_time_s = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", _PHASE_BUCKETS_S
        )
        self.inference_time_s = histogram(
            "request_inference_time_seconds", "Time from first running to the last token.", _PHASE_BUCKETS_S
        )
        self.time_per_output_token_s = histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time / (generated tokens - 1).",
            _TPOT_BUCKETS_S,
        )
        token_buckets = _tokens_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Most tokens generated by one of a request's choices.",
            token_buckets,
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens a request allowed.", token_buckets
        )
        self.request_params_n = histogram("request_params_n", "Choices (n) per request.", (1, 2, 5, 10, 20))
        self.ttft_s = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency_s = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between tokens of a request.",
            labels,
            buckets=_ITL_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_latency_s = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            labels,
            buckets=_E2E_BUCKETS_S,
            registry=self.registry,
        ).labels(model_name)
        requests = Counter(
            PREFIX + "requests",
            "Finished requests by finish reason.",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self._requests = requests
        self._model_name = model_name
        self.rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests refused by admission control.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.registry.register(_EngineCollector(stats_fn, model_name))

    def request_finished(self, finish_reason: str) -> None:
        self._requests.labels(self._model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self._exposition)
