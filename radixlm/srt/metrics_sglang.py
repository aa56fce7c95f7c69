"""Prometheus metrics under SGLang's names (`sglang:` prefix, `model_name` label), beside
radixlm's own: SGLang's Grafana dashboard, the gateway's load-aware policies and the
peers' tooling read these names, so a radixlm worker drops into an SGLang fleet.

    gauges      num_running_reqs, num_queue_reqs, num_grammar_queue_reqs, num_used_tokens,
                token_usage (KV held by requests, evictable cache excluded, as SGLang counts it),
                max_total_num_tokens, cache_hit_rate, gen_throughput, new_token_ratio,
                spec_accept_length, spec_accept_rate
    counters    prompt_tokens_total, generation_tokens_total, cached_tokens_total,
                num_requests_total, num_aborted_requests_total (per finished request, as SGLang
                counts them), num_retracted_requests_total, evicted_tokens_total
    histograms  time_to_first_token_seconds, inter_token_latency_seconds,
                time_per_output_token_seconds (the older name dashboards still use),
                e2e_request_latency_seconds

Gauges and the scheduler's counters are read from the scheduler when /metrics is scraped.
Every `sglang:` family is also served as `sglang_` (`underscore_copies`): SGLang's newer
exporters name them so and current gateways and dashboards read either spelling.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1,
               0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
LABELS = ["model_name"]


class DecodeRate:
    """Tokens decoded per second since the previous reading (SGLang reports it over its log
    interval; a reader that polls, a Prometheus scrape or a gateway's load poll, needs no timer)."""

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None  # (time, decode tokens) at the last reading
        self.value = 0.0

    def update(self, decoded: int) -> float:
        now = time.monotonic()
        if self._last is not None and now > self._last[0]:
            self.value = max(0, decoded - self._last[1]) / (now - self._last[0])
        self._last = (now, decoded)
        return self.value


class SGLangMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: Callable[[], str]) -> None:
        self.model_name = model_name
        r = registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", LABELS, registry=r)
        self.requests = Counter("sglang:num_requests", "Number of requests processed.", LABELS, registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", LABELS, registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("sglang:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", LABELS, buckets=ITL_BUCKETS,
                              registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             LABELS, buckets=E2E_BUCKETS, registry=r)
        self._info: dict | None = None
        self._cache_hit_rate = 0.0
        self.decode_rate = DecodeRate()  # over the time between scrapes
        r.register(_SchedulerFamilies(self))

    # ------------------------------------------------------------------ per request
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(self.model_name()).observe(seconds)

    def observe_itl(self, seconds_per_token: float, num_tokens: int) -> None:
        h = self.itl.labels(self.model_name())
        for _ in range(max(num_tokens, 1)):
            h.observe(seconds_per_token)

    def on_finish(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, e2e: float,
                  ttft: float | None, aborted: bool) -> None:
        name = self.model_name()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        if cached_tokens > 0:
            self.cached_tokens.labels(name).inc(cached_tokens)
        self.requests.labels(name).inc()
        if aborted:
            self.aborted.labels(name).inc()
        self.e2e.labels(name).observe(e2e)
        if ttft is not None and completion_tokens > 1:
            self.tpot.labels(name).observe(max(0.0, e2e - ttft) / (completion_tokens - 1))

    # ------------------------------------------------------------------ at scrape
    def update(self, scheduler_info: dict | None, cache_hit_rate: float) -> None:
        self._cache_hit_rate = cache_hit_rate
        if not scheduler_info:
            return
        self._info = scheduler_info
        self.decode_rate.update(int(scheduler_info.get("num_decode_tokens", 0)))


class _SchedulerFamilies:
    """The scheduler's state as SGLang's gauges and counters, from the last scrape's snapshot."""

    def __init__(self, metrics: SGLangMetrics) -> None:
        self.m = metrics

    def collect(self):
        info = self.m._info
        if info is None:
            return
        name = [self.m.model_name()]
        mem = info["memory"]
        capacity = max(int(mem["capacity"]), 1)
        used = max(0, capacity - int(mem["free"]) - int(mem["evictable"]))

        def gauge(metric: str, doc: str, value: float):
            fam = GaugeMetricFamily(metric, doc, labels=LABELS)
            fam.add_metric(name, float(value))
            return fam

        def counter(metric: str, doc: str, value: float):
            fam = CounterMetricFamily(metric, doc, labels=LABELS)
            fam.add_metric(name, float(value))
            return fam

        yield gauge("sglang:num_running_reqs", "The number of running requests.", info["num_running_reqs"])
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", info["num_waiting_reqs"])
        yield gauge("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.",
                    info.get("num_grammar_queue_reqs", 0))
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", used)
        yield gauge("sglang:token_usage", "The token usage.", used / capacity)
        yield gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", capacity)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", self.m._cache_hit_rate)
        yield gauge("sglang:gen_throughput", "The generation throughput (token/s).", self.m.decode_rate.value)
        yield gauge("sglang:new_token_ratio", "The new token ratio.", info.get("new_token_ratio", 0.0))
        # always there (SGLang's metrics tests read it): 0 while speculative decoding is off
        yield gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
                    info.get("spec_accept_length", 0.0))
        yield gauge("sglang:spec_accept_rate", "The average acceptance rate of speculative decoding.",
                    info.get("spec_accept_rate", 0.0))
        yield counter("sglang:num_retracted_requests", "Total number of retracted requests.",
                      info.get("num_retractions", 0))
        yield counter("sglang:evicted_tokens", "The number of tokens evicted from the prefix cache.",
                      info.get("evicted_tokens_total", 0))


_PREFIX = b"sglang:"


def underscore_copies(exposition: bytes) -> bytes:
    """The `sglang:` families of a Prometheus text exposition again under `sglang_` names (each
    family's HELP, TYPE and samples, in order), to append to the exposition."""
    out = []
    for line in exposition.splitlines(keepends=True):
        if line.startswith(_PREFIX):
            out.append(b"sglang_" + line[len(_PREFIX):])
        elif line.startswith((b"# HELP sglang:", b"# TYPE sglang:")):
            out.append(line[:7] + b"sglang_" + line[7 + len(_PREFIX):])
    return b"".join(out)
