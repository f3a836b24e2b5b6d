"""/metrics through prometheus_client: the project's families (prefix `dsv41:`) and, beside them, vLLM's names
(prefix `vllm:`, label `model_name`), so dashboards made for vLLM read this server too.

Counters and histograms are bumped by the API and the scheduler (all on the event loop, so no locks); gauges, and
the scheduler's own counters (tokens, rounds, drafts, kept states, grammar time), are read when scraped: Metrics is a
prometheus_client collector over that state, in a registry of its own (docs/server.md lists every family).
"""
from __future__ import annotations

import collections
import time

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
# our finish reasons -> vLLM's finished_reason label
_VLLM_REASON = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "abort"}


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)     # cumulative: observations <= each bound
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def family(self, name: str, help_: str, labels: dict[str, str] | None = None) -> HistogramMetricFamily:
        f = HistogramMetricFamily(name, help_, labels=list(labels or {}))
        buckets = [(str(b), c) for b, c in zip(self.buckets, self.counts)] + [("+Inf", self.count)]
        f.add_metric(list((labels or {}).values()), buckets, self.sum)
        return f


class Metrics:
    PREFIX = "dsv41:"

    def __init__(self):
        self.started = time.time()
        self.requests_total: collections.Counter[tuple[str, int]] = collections.Counter()
        self.finished_total: collections.Counter[str] = collections.Counter()
        self.client_disconnections_total = 0
        self.grammar_compile_seconds = 0.0  # compiling request grammars (the API, per request)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.prefill = Histogram(LATENCY_BUCKETS)
        self.decode = Histogram(LATENCY_BUCKETS)
        self.scheduler = None           # set once the engine is up
        self.model_name = ""            # the served id, vLLM's model_name label (set with the scheduler)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # --- hooks ---------------------------------------------------------------------------------------------------
    def request_done(self, route: str, status: int) -> None:
        self.requests_total[(route, status)] += 1

    def request_finished(self, req) -> None:
        """Called by the scheduler when a request leaves it (any reason)."""
        self.finished_total[req.finish_reason or "unknown"] += 1
        end = req.finish_time or time.monotonic()
        self.latency.observe(end - req.arrival)
        if req.admit_time is not None:
            self.queue.observe(req.admit_time - req.arrival)
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival)
            if req.admit_time is not None:
                self.prefill.observe(req.first_token_time - req.admit_time)
            self.decode.observe(end - req.first_token_time)
            if len(req.output_ids) > 1:
                self.tpot.observe((end - req.first_token_time) / (len(req.output_ids) - 1))

    # --- exposition ----------------------------------------------------------------------------------------------
    def render(self) -> str:
        """The Prometheus text format 0.0.4 (CONTENT_TYPE)."""
        return generate_latest(self.registry).decode()

    def collect(self):
        """prometheus_client's collector hook: every family, read now."""
        p = self.PREFIX
        s = self.scheduler
        v = {"model_name": self.model_name}            # vLLM's label

        def gauge(name: str, value, help_: str, labels: dict | None = None) -> GaugeMetricFamily:
            f = GaugeMetricFamily(name, help_, labels=list(labels or {}))
            f.add_metric(list((labels or {}).values()), value)
            return f

        def counter(name: str, value, help_: str, labels: dict | None = None) -> CounterMetricFamily:
            f = CounterMetricFamily(name, help_, labels=list(labels or {}))
            f.add_metric(list((labels or {}).values()), value)
            return f

        if s is not None:
            yield gauge(p + "requests_running", s.n_running, "requests holding a sequence (prompt filling or decoding)")
            yield gauge(p + "requests_waiting", s.n_waiting, "requests queued for a sequence")
            yield gauge(p + "generation_tokens_running", sum(len(r.output_ids) for r in s.running),
                        "reply tokens held by running requests")
            yield gauge(p + "kv_cache_usage_ratio", round(s.budget.usage, 6), "share of the state budget reserved")
            yield gauge(p + "state_budget_bytes", s.budget.budget, "bytes for sequence states")
            yield gauge(p + "worst_decode_round_seconds", round(s.worst_round_s, 6),
                        "longest round that carried decode rows (the worst stall of a running reply)")
            yield counter(p + "prompt_tokens_total", s.prompt_tokens_total, "prompt rows computed")
            yield counter(p + "generation_tokens_total", s.generation_tokens_total, "tokens drawn")
            yield counter(p + "decode_rounds_total", s.rounds_total, "rounds run")
            mask_s = float(getattr(getattr(s, "runner", None), "grammar_seconds", 0.0))
            f = CounterMetricFamily(p + "grammar_seconds", "seconds spent on request grammars: compiling them "
                                    "(compile) and computing the token masks of constrained rows (mask)",
                                    labels=["part"])
            f.add_metric(["compile"], self.grammar_compile_seconds)
            f.add_metric(["mask"], mask_s)
            yield f
            yield gauge("vllm:num_requests_running", s.n_running, "Number of requests in model execution batches.", v)
            yield gauge("vllm:num_requests_waiting", s.n_waiting, "Number of requests waiting to be processed.", v)
            yield gauge("vllm:kv_cache_usage_perc", round(s.budget.usage, 6),
                        "KV-cache usage. 1 means 100 percent usage.", v)
            yield counter("vllm:prompt_tokens_total", s.prompt_tokens_total, "Number of prefill tokens processed.", v)
            yield counter("vllm:generation_tokens_total", s.generation_tokens_total,
                          "Number of generation tokens processed.", v)
            if getattr(s, "policy", None) is not None:     # drafting on (docs/drafts.md)
                d = s.draft_stats
                yield counter(p + "draft_tokens_total", d.drafted, "draft tokens verified")
                yield counter(p + "draft_accepted_tokens_total", d.accepted, "draft tokens accepted")
                yield counter(p + "draft_rounds_total", d.rounds, "sequence rounds that verified a draft")
                yield gauge(p + "draft_tokens_per_round", round(d.tokens / d.rounds, 4) if d.rounds else 0,
                            "reply tokens a sequence got per round that verified a draft")
                yield counter("vllm:spec_decode_num_drafts_total", d.rounds, "Number of spec decoding drafts.", v)
                yield counter("vllm:spec_decode_num_draft_tokens_total", d.drafted, "Number of draft tokens.", v)
                yield counter("vllm:spec_decode_num_accepted_tokens_total", d.accepted,
                              "Number of accepted tokens.", v)
            kept = getattr(s, "kept", None)
            if kept is not None:
                for kind, name, value, help_ in kept.metric_values():
                    yield (gauge if kind == "gauge" else counter)(p + name, value, help_)
                yield counter("vllm:prefix_cache_queries_total", kept.hit_tokens + s.prompt_tokens_total,
                              "Prefix cache queries, in terms of number of queried tokens.", v)
                yield counter("vllm:prefix_cache_hits_total", kept.hit_tokens,
                              "Prefix cache hits, in terms of number of cached tokens.", v)
        f = CounterMetricFamily(p + "requests_total", "HTTP requests by route and status", labels=["route", "status"])
        for (route, status), n in sorted(self.requests_total.items()):
            f.add_metric([route, str(status)], n)
        yield f
        f = CounterMetricFamily(p + "request_finished_total", "requests that left the scheduler, by finish reason",
                                labels=["reason"])
        for reason, n in sorted(self.finished_total.items()):
            f.add_metric([reason], n)
        yield f
        f = CounterMetricFamily("vllm:request_success_total", "Count of successfully processed requests.",
                                labels=["model_name", "finished_reason"])
        by_reason: collections.Counter[str] = collections.Counter()
        for reason, n in self.finished_total.items():
            by_reason[_VLLM_REASON.get(reason, "abort")] += n
        for reason, n in sorted(by_reason.items()):
            f.add_metric([self.model_name, reason], n)
        yield f
        yield counter(p + "client_disconnections_total", self.client_disconnections_total,
                      "clients gone before the end")
        for name, vname, h, help_ in (
                ("time_to_first_token_seconds", "time_to_first_token_seconds", self.ttft,
                 "Histogram of time to first token in seconds."),
                ("request_time_per_output_token_seconds", "time_per_output_token_seconds", self.tpot,
                 "Histogram of time per output token in seconds."),
                ("request_latency_seconds", "e2e_request_latency_seconds", self.latency,
                 "Histogram of e2e request latency in seconds."),
                ("request_queue_seconds", "request_queue_time_seconds", self.queue,
                 "Histogram of time spent in WAITING phase for request."),
                ("request_prefill_seconds", "request_prefill_time_seconds", self.prefill,
                 "Histogram of time spent in PREFILL phase for request."),
                ("request_decode_seconds", "request_decode_time_seconds", self.decode,
                 "Histogram of time spent in DECODE phase for request.")):
            yield h.family(p + name, help_)
            yield h.family("vllm:" + vname, help_, v)
