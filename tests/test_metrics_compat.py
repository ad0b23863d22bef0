"""vLLM's metric names (``--metrics-compat vllm``): present, with vLLM's types and labels, carrying the
values Augur's own series carry, after real traffic to a live speculating server; absent with ``none``."""

from __future__ import annotations

import time

import httpx
import pytest
from test_server import grown, metric, parse_metrics, scrape

from server.app import ServerSettings, create_app
from server.cli import build_parser
from server.metrics import Metrics
from servers import engine_factory, serve, wait_until

MODEL = "compat-demo"
VLLM = {"model_name": MODEL, "engine": "0"}

# name -> Prometheus type, as vLLM exports them (a counter's samples, and its TYPE line in the text
# format, carry a _total suffix).
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


def types(text: str) -> dict[str, str]:
    return {p[2]: p[3] for p in (line.split() for line in text.splitlines() if line.startswith("# TYPE "))}


def spec_server(tiny_demo, compat: str):
    factory = engine_factory(
        tiny_demo / "target",
        draft_model=str(tiny_demo / "draft"),
        speculative_method="draft",
        num_speculative_tokens=3,
    )
    return serve(create_app(ServerSettings(served_model_name=MODEL, metrics_compat=compat), factory))


@pytest.fixture(scope="module")
def srv(tiny_demo):
    with spec_server(tiny_demo, "vllm") as s:
        yield s


def idle(srv) -> None:
    wait_until(lambda: srv.async_engine.load.running == 0 and srv.async_engine.load.waiting == 0, "an idle engine")


def test_vllm_series_carry_augurs_values_after_traffic(srv, client, http):
    idle(srv)
    before = scrape(http)
    prompt = "def parse(self, text):\n    for line in text.splitlines():\n"
    # A fixed draft depth: the controller may rightly judge drafting unprofitable on a busy machine.
    draft = {"speculative": {"num_draft_tokens": 3}}
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=draft)
    b = client.completions.create(  # a prefix-cache hit
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=draft
    )
    tok_eos = srv.engine.eos_token_ids[0]
    stopped = client.completions.create(
        model=MODEL, prompt="import os\n", max_tokens=4, temperature=0, logit_bias={str(tok_eos): 100}
    )
    assert stopped.choices[0].finish_reason == "stop"
    idle(srv)
    text = http.get("/metrics").text
    after = parse_metrics(text)

    found = types(text)
    for name, kind in VLLM_TYPES.items():
        name += "_total" if kind == "counter" else ""
        assert found.get(name) == kind, (name, found.get(name))

    def grew(name: str, **labels: str) -> float:
        return grown(before, after, name, **labels)

    prompt_tokens = a.usage.prompt_tokens + b.usage.prompt_tokens + stopped.usage.prompt_tokens
    generated = a.usage.completion_tokens + b.usage.completion_tokens + stopped.usage.completion_tokens
    assert grew("vllm:prompt_tokens_total", **VLLM) == prompt_tokens == grew("augur_prompt_tokens_total")
    assert grew("vllm:generation_tokens_total", **VLLM) == generated == grew("augur_generation_tokens_total")
    assert grew("vllm:request_success_total", **VLLM, finished_reason="length") == 2
    assert grew("vllm:request_success_total", **VLLM, finished_reason="stop") == 1
    for vllm_name, augur_name in [
        ("vllm:time_to_first_token_seconds", "augur_time_to_first_token_seconds"),
        ("vllm:inter_token_latency_seconds", "augur_inter_token_latency_seconds"),
        ("vllm:request_time_per_output_token_seconds", "augur_time_per_output_token_seconds"),
        ("vllm:e2e_request_latency_seconds", "augur_e2e_request_latency_seconds"),
    ]:
        assert grew(vllm_name + "_count", **VLLM) == grew(augur_name + "_count") > 0, vllm_name
        assert grew(vllm_name + "_sum", **VLLM) == pytest.approx(grew(augur_name + "_sum")), vllm_name
    assert grew("vllm:e2e_request_latency_seconds_count", **VLLM) == 3
    assert grew("vllm:request_prompt_tokens_sum", **VLLM) == prompt_tokens
    assert grew("vllm:request_generation_tokens_sum", **VLLM) == generated
    assert grew("vllm:request_generation_tokens_count", **VLLM) == 3

    # Speculation: the same counts as augur_spec_decode_* (labelled by method there).
    drafts = grew("vllm:spec_decode_num_drafts_total", **VLLM)
    assert drafts > 0 and drafts == grew("augur_spec_decode_num_drafts_total")
    accepted = grew("vllm:spec_decode_num_accepted_tokens_total", **VLLM)
    assert accepted == grew("augur_spec_decode_num_accepted_tokens_total")
    assert grew("vllm:spec_decode_num_draft_tokens_total", **VLLM) == grew("augur_spec_decode_num_draft_tokens_total")
    assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", **VLLM) == accepted
    assert grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", **VLLM, position="0") <= drafts

    # Prefix cache: every prompt token was looked up, and the repeated prompt found its blocks.
    assert grew("vllm:prefix_cache_queries_total", **VLLM) >= prompt_tokens
    block = srv.engine.config.block_size
    assert grew("vllm:prefix_cache_hits_total", **VLLM) >= (b.usage.prompt_tokens // block - 1) * block > 0
    assert metric(after, "vllm:num_preemptions_total", **VLLM) == 0

    # Gauges and info series.
    assert metric(after, "vllm:num_requests_running", **VLLM) == 0
    assert metric(after, "vllm:num_requests_waiting", **VLLM) == 0
    usage = metric(after, "vllm:kv_cache_usage_perc", **VLLM)
    assert 0 <= usage <= 1 and usage == metric(after, "augur_kv_cache_usage_ratio")
    assert metric(after, "vllm:gpu_cache_usage_perc", **VLLM) == usage
    info = [(lab, v) for n, lab, v in after if n == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0][1] == 1
    assert info[0][0]["block_size"] == str(block)
    assert info[0][0]["num_gpu_blocks"] == str(srv.engine.block_manager.num_blocks)
    assert info[0][0]["cache_dtype"] == "float32" and info[0][0]["engine"] == "0"
    lora = [(lab, v) for n, lab, v in after if n == "vllm:lora_requests_info"]
    assert lora == [({"max_lora": "0", "waiting_lora_adapters": "", "running_lora_adapters": ""}, lora[0][1])]
    assert abs(lora[0][1] - time.time()) < 600  # a timestamp, as vLLM's is


def test_running_request_shows_in_the_gauges(srv, client, http):
    idle(srv)
    body = {"ignore_eos": True}  # 400 tokens: the request runs for a good while after its first chunk
    stream = client.completions.create(
        model=MODEL, prompt="class Parser:\n", max_tokens=400, temperature=0, stream=True, extra_body=body
    )
    chunks = iter(stream)
    next(chunks)  # the request is running now
    samples = scrape(http)
    for _ in chunks:
        pass
    assert metric(samples, "vllm:num_requests_running", **VLLM) == 1
    assert metric(samples, "vllm:num_requests_waiting", **VLLM) == 0
    assert 0 < metric(samples, "vllm:kv_cache_usage_perc", **VLLM) <= 1


def test_compat_none_exports_only_augur(tiny_demo):
    with spec_server(tiny_demo, "none") as s, httpx.Client(base_url=s.base, timeout=120) as http:
        body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": 4}
        assert http.post("/v1/completions", json=body).status_code == 200
        names = {n for n, _, _ in scrape(http)}
    assert not {n for n in names if n.startswith("vllm:")}
    assert "augur_prompt_tokens_total" in names and "augur_num_requests_running" in names


def test_compat_flag():
    assert build_parser().parse_args(["serve"]).metrics_compat == "vllm"
    assert build_parser().parse_args(["serve", "--metrics-compat", "none"]).metrics_compat == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-compat", "prometheus"])
    with pytest.raises(ValueError, match="compat"):
        Metrics("m", compat="prometheus")
