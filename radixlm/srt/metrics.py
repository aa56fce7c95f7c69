"""Prometheus metrics of the runtime (prefix `radixlm:`), one registry per TokenizerManager;
the same registry also carries SGLang's names (`sglang:`, metrics_sglang.py).

Counters and latency histograms are recorded where requests are seen (the tokenizer
manager); scheduler gauges are read from the scheduler when /metrics is scraped.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlm.srt.metrics_sglang import SGLangMetrics, underscore_copies

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))


class _CancelLatencyCollector:
    """Exports the scheduler's cumulative cancel-latency histogram as a Prometheus histogram."""

    def __init__(self, metrics: "RuntimeMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily
        h = self.metrics._last_hist
        fam = HistogramMetricFamily("radixlm:cancel_latency_seconds", "abort call to KV returned")
        if h:
            bounds = ["+Inf" if b == float("inf") else repr(b) for b in h["buckets"]]
            fam.add_metric([], list(zip(bounds, h["counts"])), h["sum"])
        yield fam


class RuntimeMetrics:
    def __init__(self, model_name: str = "default") -> None:
        # the `model_name` label of the sglang: metrics (the HTTP server sets its served name)
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.requests = Counter("radixlm:num_requests", "requests received", registry=r)
        self.aborted = Counter("radixlm:num_aborted_requests", "requests that ended with abort", registry=r)
        self.prompt_tokens = Counter("radixlm:prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("radixlm:generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("radixlm:cached_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram("radixlm:time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixlm:inter_token_latency_seconds", "time between tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixlm:e2e_request_latency_seconds", "request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("radixlm:num_running_reqs", "requests decoding", registry=r)
        self.queued = Gauge("radixlm:num_queue_reqs", "requests waiting", registry=r)
        self.token_usage = Gauge("radixlm:token_usage", "fraction of KV slots held by requests or cache",
                                 registry=r)
        self.cache_hit_rate = Gauge("radixlm:cache_hit_rate", "cached / prompt tokens", registry=r)
        self.new_token_ratio = Gauge("radixlm:new_token_ratio", "decode reservation ratio", registry=r)
        self.retractions = Gauge("radixlm:num_retracted_requests_total", "retractions so far", registry=r)
        self.aborts_by_place = Gauge("radixlm:aborts", "aborts applied by the scheduler, by where the request was",
                                     ["place"], registry=r)
        # --enable-priority-scheduling (scheduler/priority.py): by the request's priority value
        self.by_priority = Gauge("radixlm:priority_requests", "requests by priority: queued and running now, "
                                 "preempted and rejected (queue full) since start", ["priority", "state"], registry=r)
        self._last_hist: dict | None = None
        r.register(_CancelLatencyCollector(self))
        self.forward_idle = Gauge("radixlm:forward_idle_fraction",
                                  "share of time the model waited on the scheduler between forwards", registry=r)
        # speculative decoding (scheduler/speculation.py); 0 while it is off
        self.spec_drafted = Gauge("radixlm:spec_draft_tokens_total", "draft tokens verified", registry=r)
        self.spec_accepted = Gauge("radixlm:spec_accepted_tokens_total", "draft tokens accepted", registry=r)
        self.spec_rate = Gauge("radixlm:spec_accept_rate", "accepted / verified draft tokens", registry=r)
        self.spec_length = Gauge("radixlm:spec_accept_length", "tokens emitted per speculative verify step",
                                 registry=r)
        # prefill/decode disaggregation (docs/disaggregation.md): this side's transfer counters
        self.transfer = Gauge("radixlm:disagg_transfer", "KV transfer counters of this disaggregation side "
                              "(bytes, chunks, rooms_* and message counts, totals since start)",
                              ["counter"], registry=r)
        self._prompt = 0
        self._cached = 0
        self.sglang = SGLangMetrics(r, lambda: self.model_name)

    def on_request(self, prompt_tokens: int) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self._prompt += prompt_tokens

    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)
        self.sglang.observe_ttft(s)

    def observe_itl(self, s: float, num_tokens: int = 1) -> None:
        self.itl.observe(s)
        self.sglang.observe_itl(s, num_tokens)

    def on_finish(self, state, out) -> None:
        self.generation_tokens.inc(out.completion_tokens)
        self.cached_tokens.inc(out.cached_tokens)
        self._cached += out.cached_tokens
        e2e = max(0.0, time.perf_counter() - state.start)
        self.e2e.observe(e2e)
        aborted = bool(out.finish_reason and out.finish_reason.get("type") == "abort")
        if aborted:
            self.aborted.inc()
        ttft = state.first_token_time - state.start if state.first_token_time is not None else None
        self.sglang.on_finish(out.prompt_tokens, out.completion_tokens, out.cached_tokens, e2e, ttft, aborted)

    def render(self, scheduler_info: dict | None) -> bytes:
        if scheduler_info:
            mem = scheduler_info["memory"]
            self.running.set(scheduler_info["num_running_reqs"])
            self.queued.set(scheduler_info["num_waiting_reqs"])
            self.token_usage.set((mem["capacity"] - mem["free"]) / max(mem["capacity"], 1))
            self.new_token_ratio.set(scheduler_info["new_token_ratio"])
            self.retractions.set(scheduler_info["num_retractions"])
            for name, value in scheduler_info.get("disaggregation", {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.transfer.labels(name).set(value)
            for place in ("waiting", "chunked", "running", "in_flight", "transfer"):
                self.aborts_by_place.labels(place).set(scheduler_info.get(f"aborts_{place}", 0))
            self.by_priority.clear()  # a priority no longer queued is not left at its last count
            for state, counts in scheduler_info.get("priority", {}).items():
                for prio, count in counts.items():
                    self.by_priority.labels(prio, state).set(count)
            self._last_hist = scheduler_info.get("cancel_latency_hist")
            self.forward_idle.set(scheduler_info.get("forward_idle_fraction", 0.0))
            self.spec_drafted.set(scheduler_info.get("spec_draft_tokens", 0))
            self.spec_accepted.set(scheduler_info.get("spec_accepted_tokens", 0))
            self.spec_rate.set(scheduler_info.get("spec_accept_rate", 0.0))
            self.spec_length.set(scheduler_info.get("spec_accept_length", 0.0))
        hit_rate = self._cached / self._prompt if self._prompt else 0.0
        self.cache_hit_rate.set(hit_rate)
        self.sglang.update(scheduler_info, hit_rate)
        text = generate_latest(self.registry)
        return text + underscore_copies(text)
