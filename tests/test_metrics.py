"""/metrics (dsv41/api/metrics.py) through prometheus_client: the official parser reads the whole text, the `dsv41:`
families keep their names and values, and vLLM's `vllm:` names stand beside them with the same figures and the
`model_name` label. A scheduler-shaped object stands in for the engine (the live server: test_openai_fields.py)."""
from __future__ import annotations

import time
from types import SimpleNamespace as NS

from prometheus_client.parser import text_string_to_metric_families

from dsv41.api.metrics import Metrics


class _Kept:
    hit_tokens = 30

    def metric_values(self):
        return [("gauge", "kept_states", 2, "kept prompt states"),
                ("counter", "kept_state_hits_total", 3, "prompts resumed from a kept state"),
                ("counter", "kept_cached_tokens_total", self.hit_tokens, "prompt tokens resumed instead of computed")]


def _scheduler():
    return NS(n_running=2, n_waiting=1, running=[NS(output_ids=[1, 2, 3]), NS(output_ids=[4])],
              budget=NS(usage=0.25, budget=1 << 30), worst_round_s=0.5, prompt_tokens_total=70,
              generation_tokens_total=12, rounds_total=9, runner=NS(grammar_seconds=0.125),
              policy=object(), draft_stats=NS(drafted=10, accepted=7, rounds=4, tokens=11), kept=_Kept())


def _families(m: Metrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render())}


def value(fams, family: str, sample: str | None = None, **labels) -> float:
    got = [s.value for s in fams[family].samples
           if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (family, sample, labels, got)
    return got[0]


def test_families_ours_and_vllms_read_by_the_prometheus_parser():
    m = Metrics()
    m.scheduler, m.model_name = _scheduler(), "tiny"
    now = time.monotonic()
    for reason in ("stop", "length", "length", "cancelled"):
        m.request_finished(NS(finish_reason=reason, finish_time=now, arrival=now - 2.0, admit_time=now - 1.5,
                              first_token_time=now - 1.0, output_ids=[1, 2, 3]))
    m.request_done("/v1/completions", 200)
    m.client_disconnections_total = 1
    m.grammar_compile_seconds = 0.25
    f = _families(m)
    assert value(f, "dsv41:requests_running") == 2 == value(f, "vllm:num_requests_running", model_name="tiny")
    assert value(f, "dsv41:requests_waiting") == 1 == value(f, "vllm:num_requests_waiting", model_name="tiny")
    assert value(f, "dsv41:generation_tokens_running") == 4
    assert value(f, "dsv41:kv_cache_usage_ratio") == 0.25 == value(f, "vllm:kv_cache_usage_perc", model_name="tiny")
    assert f["vllm:prompt_tokens"].type == "counter"
    assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model_name="tiny") == 70
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", model_name="tiny") == 12
    assert value(f, "dsv41:decode_rounds", "dsv41:decode_rounds_total") == 9
    assert value(f, "dsv41:grammar_seconds", "dsv41:grammar_seconds_total", part="mask") == 0.125
    assert value(f, "dsv41:grammar_seconds", "dsv41:grammar_seconds_total", part="compile") == 0.25
    assert value(f, "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total",
                 model_name="tiny") == 10 == value(f, "dsv41:draft_tokens", "dsv41:draft_tokens_total")
    assert value(f, "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total",
                 model_name="tiny") == 7
    assert value(f, "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total", model_name="tiny") == 4
    assert value(f, "dsv41:kept_states") == 2 and value(f, "dsv41:kept_state_hits", "dsv41:kept_state_hits_total") == 3
    assert value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", model_name="tiny") == 30
    assert value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", model_name="tiny") == 100
    assert value(f, "dsv41:request_finished", "dsv41:request_finished_total", reason="length") == 2
    ok = "vllm:request_success_total"
    assert value(f, "vllm:request_success", ok, model_name="tiny", finished_reason="length") == 2
    assert value(f, "vllm:request_success", ok, model_name="tiny", finished_reason="abort") == 1   # cancelled
    assert value(f, "dsv41:requests", "dsv41:requests_total", route="/v1/completions", status="200") == 1
    assert value(f, "dsv41:client_disconnections", "dsv41:client_disconnections_total") == 1
    for ours, theirs in (("time_to_first_token_seconds", "time_to_first_token_seconds"),
                         ("request_latency_seconds", "e2e_request_latency_seconds"),
                         ("request_time_per_output_token_seconds", "time_per_output_token_seconds"),
                         ("request_queue_seconds", "request_queue_time_seconds"),
                         ("request_prefill_seconds", "request_prefill_time_seconds"),
                         ("request_decode_seconds", "request_decode_time_seconds")):
        assert f["dsv41:" + ours].type == f["vllm:" + theirs].type == "histogram"
        assert value(f, "dsv41:" + ours, f"dsv41:{ours}_count") == 4 \
            == value(f, "vllm:" + theirs, f"vllm:{theirs}_count", model_name="tiny")
    assert value(f, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_bucket",
                 model_name="tiny", le="1.0") == 0                              # 2 s each
    assert value(f, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_bucket",
                 model_name="tiny", le="2.5") == 4
    assert value(f, "dsv41:request_time_per_output_token_seconds",
                 "dsv41:request_time_per_output_token_seconds_sum") == 4 * 0.5   # 1 s over 2 later tokens


def test_before_the_engine_is_up_only_the_request_families():
    f = _families(Metrics())
    assert "dsv41:requests_running" not in f and "vllm:num_requests_running" not in f
    assert value(f, "dsv41:client_disconnections", "dsv41:client_disconnections_total") == 0
    assert f["vllm:time_to_first_token_seconds"].type == "histogram"
