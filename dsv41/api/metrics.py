"""Prometheus text (format 0.0.4) for /metrics: written by hand, families prefixed `dsv41:`.

Gauges are read from the scheduler when scraped; counters and histograms are bumped by the API and the scheduler
(all on the event loop, so no locks). Kept-state and draft families come from the scheduler's own counters
(docs/server.md lists every family).
"""
from __future__ import annotations

import collections
import time

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        for b, c in zip(self.buckets, self.counts):
            out.append(f'{name}_bucket{{le="{b}"}} {c}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    PREFIX = "dsv41:"

    def __init__(self):
        self.started = time.time()
        self.requests_total: collections.Counter[tuple[str, int]] = collections.Counter()
        self.finished_total: collections.Counter[str] = collections.Counter()
        self.client_disconnections_total = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.prefill = Histogram(LATENCY_BUCKETS)
        self.decode = Histogram(LATENCY_BUCKETS)
        self.scheduler = None           # set once the engine is up

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

    # --- text ----------------------------------------------------------------------------------------------------
    def render(self) -> str:
        p = self.PREFIX
        s = self.scheduler
        lines: list[str] = []

        def gauge(name: str, value, help_: str) -> None:
            lines.extend([f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} gauge", f"{p}{name} {value}"])

        def counter(name: str, value, help_: str) -> None:
            lines.extend([f"# HELP {p}{name} {help_}", f"# TYPE {p}{name} counter", f"{p}{name} {value}"])

        if s is not None:
            gauge("requests_running", s.n_running, "requests holding a sequence (prompt filling or decoding)")
            gauge("requests_waiting", s.n_waiting, "requests queued for a sequence")
            gauge("generation_tokens_running", sum(len(r.output_ids) for r in s.running),
                  "reply tokens held by running requests")
            gauge("kv_cache_usage_ratio", round(s.budget.usage, 6), "share of the state budget reserved")
            gauge("state_budget_bytes", s.budget.budget, "bytes for sequence states")
            gauge("worst_decode_round_seconds", round(s.worst_round_s, 6),
                  "longest round that carried decode rows (the worst stall of a running reply)")
            counter("prompt_tokens_total", s.prompt_tokens_total, "prompt rows computed")
            counter("generation_tokens_total", s.generation_tokens_total, "tokens drawn")
            counter("decode_rounds_total", s.rounds_total, "rounds run")
            # vLLM-named mirrors
            gauge("num_requests_running", s.n_running, "vLLM name of requests_running")
            gauge("num_requests_waiting", s.n_waiting, "vLLM name of requests_waiting")
            gauge("kv_cache_usage_perc", round(s.budget.usage, 6), "vLLM name of kv_cache_usage_ratio")
            if getattr(s, "policy", None) is not None:     # drafting on (docs/drafts.md)
                d = s.draft_stats
                counter("draft_tokens_total", d.drafted, "draft tokens verified")
                counter("draft_accepted_tokens_total", d.accepted, "draft tokens accepted")
                counter("draft_rounds_total", d.rounds, "sequence rounds that verified a draft")
                gauge("draft_tokens_per_round", round(d.tokens / d.rounds, 4) if d.rounds else 0,
                      "reply tokens a sequence got per round that verified a draft")
                counter("spec_decode_num_draft_tokens_total", d.drafted, "vLLM name of draft_tokens_total")
                counter("spec_decode_num_accepted_tokens_total", d.accepted,
                        "vLLM name of draft_accepted_tokens_total")
            if getattr(s, "kept", None) is not None:
                lines.extend(s.kept.metric_lines(p))
        lines.append(f"# HELP {p}requests_total HTTP requests by route and status")
        lines.append(f"# TYPE {p}requests_total counter")
        for (route, status), n in sorted(self.requests_total.items()):
            lines.append(f'{p}requests_total{{route="{route}",status="{status}"}} {n}')
        lines.append(f"# HELP {p}request_finished_total requests that left the scheduler, by finish reason")
        lines.append(f"# TYPE {p}request_finished_total counter")
        for reason, n in sorted(self.finished_total.items()):
            lines.append(f'{p}request_finished_total{{reason="{reason}"}} {n}')
        counter("client_disconnections_total", self.client_disconnections_total, "clients gone before the end")
        for name, h in (("time_to_first_token_seconds", self.ttft),
                        ("request_time_per_output_token_seconds", self.tpot),
                        ("request_latency_seconds", self.latency),
                        ("request_queue_seconds", self.queue),
                        ("request_prefill_seconds", self.prefill),
                        ("request_decode_seconds", self.decode)):
            lines.extend(h.lines(p + name))
        return "\n".join(lines) + "\n"
