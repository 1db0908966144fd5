"""Metrics under Hearth's names and vLLM's: the scrape text, and every panel of vLLM's example Grafana
dashboard (and Hearth's server panels) evaluated by a real Prometheus scraping a live server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_model

from hearth.engine.messages import EngineStats
from hearth.server.metrics import ServerMetrics
from hearth.server.process import ServerProcess

MODEL = "tiny-served"
# The 12 panels of vLLM's example dashboard (examples/observability/prometheus_grafana/grafana.json), one
# list of target expressions per panel, written out here; $model_name and $__rate_interval are filled in.
VLLM_PANELS: dict[str, list[str]] = {
    "E2E Request Latency": [
        *(
            f'histogram_quantile({q}, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{{model_name="$model_name"}}[$__rate_interval])))'
            for q in (0.99, 0.95, 0.9, 0.5)
        ),
        'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Token Throughput": [
        'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    ],
    "Inter Token Latency": [
        *(
            f'histogram_quantile({q}, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{{model_name="$model_name"}}[$__rate_interval])))'
            for q in (0.99, 0.95, 0.9, 0.5)
        ),
        'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Scheduler State": [
        'vllm:num_requests_running{model_name="$model_name"}',
        'vllm:num_requests_waiting{model_name="$model_name"}',
    ],
    "Time To First Token Latency": [
        *(
            f'histogram_quantile({q}, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{{model_name="$model_name"}}[$__rate_interval])))'
            for q in (0.99, 0.95, 0.9, 0.5)
        ),
        'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Cache Utilization": ['vllm:kv_cache_usage_perc{model_name="$model_name"}'],
    "Request Prompt Length": [
        'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'
    ],
    "Request Generation Length": [
        'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'
    ],
    "Finish Reason": [
        'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))'
    ],
    "Queue Time": ['rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'],
    "Requests Prefill and Decode Time": [
        'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    ],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])'
    ],
}
HEARTH_DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "hearth.json"


def _families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_vllm_names_mirror_hearths_with_vllms_labels() -> None:
    stats = EngineStats(
        num_running=2, num_waiting=1, kv_pages_used=3, kv_pages_total=12, kv_tokens_total=192,
        prefix_cache_queries_tokens=10, prefix_cache_hit_tokens=4, prompt_tokens_total=50, cached_tokens_total=4,
        generation_tokens_total=20, num_preemptions_total=5, kv_integrity_failures_total=0,
        kv_transfer_failures_total=0, kv_recomputed_tokens_total=0, kv_transfer_pages_total=0,
    )  # fmt: skip
    metrics = ServerMetrics("m", lambda: stats)
    metrics.request_finished("stop")
    metrics.ttft_s.observe(0.2)
    families = _families(metrics.render().decode())
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    assert families["vllm:gpu_cache_usage_perc"].samples[0].value == 0.25
    assert families["vllm:num_preemptions"].samples[0].value == 5
    assert families["vllm:num_requests_running"].samples[0].labels == {"model_name": "m"}
    success = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert success[0].labels == {"model_name": "m", "finished_reason": "stop"} and success[0].value == 1
    ttft = families["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert [s.value for s in ttft.samples if s.name.endswith("_count")] == [1]
    assert "hearth_time_to_first_token_seconds" in families  # Hearth's own names stay


# ---- live: a real Prometheus scraping a real server -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("metrics")
    model = make_tiny_model(root / "tiny")
    args = [str(model), "--served-model-name", MODEL, "--kv-cache-memory", "0.02", "--max-model-len", "512"]
    with ServerProcess(args, root / "server.log") as process:
        yield process


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    root = tmp_path_factory.mktemp("prometheus")
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: hearth\n    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
    )
    port = _free_port()
    log = (root / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (root / "prometheus.log").read_text()[-2000:]
            try:
                response = httpx.get(url + "/api/v1/query", params={"query": "up"}, timeout=2)
                # Until its storage is open Prometheus answers 503 "Service Unavailable" (plain text).
                if response.status_code == 200:
                    up = response.json()
                    if up["data"]["result"] and up["data"]["result"][0]["value"][1] == "1":
                        break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (root / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _traffic(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i in range(6):
            body = {
                "model": MODEL,
                "prompt": f"hello {i} " * (i + 1),
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            }
            assert http.post("/v1/completions", json=body).status_code == 200
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
        with http.stream("POST", "/v1/chat/completions", json=chat) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass


def _query(prometheus: str, expression: str) -> list[dict]:
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": expression}, timeout=10).json()
    assert answer["status"] == "success", (expression, answer)
    return answer["data"]["result"]


@pytest.fixture(scope="module")
def scraped(server: ServerProcess, prometheus: str) -> str:
    time.sleep(2)  # samples before the traffic, so rates over the window see it
    _traffic(server)
    time.sleep(3)  # and after
    return prometheus


def _fill(expression: str, rate_interval: str = "1m") -> str:
    return (
        expression.replace("$model_name", MODEL)
        .replace("$model", MODEL)
        .replace("$__rate_interval", rate_interval)
    )


@pytest.mark.parametrize("panel", list(VLLM_PANELS))
def test_every_panel_of_vllms_dashboard_returns_data(scraped: str, panel: str) -> None:
    for expression in VLLM_PANELS[panel]:
        result = _query(scraped, _fill(expression))
        assert result, f"{panel}: {expression} returned nothing"
        values = [float(series["value"][1]) for series in result]
        assert any(value == value for value in values), f"{panel}: only NaN from {expression}"  # not all NaN


def test_the_dashboards_traffic_shows_up(scraped: str) -> None:
    generated = _query(scraped, _fill('increase(vllm:generation_tokens_total{model_name="$model_name"}[1m])'))
    assert float(generated[0]["value"][1]) > 0
    reasons = _query(scraped, _fill(VLLM_PANELS["Finish Reason"][0]))
    assert {series["metric"]["finished_reason"] for series in reasons} >= {"length"}


def test_hearths_dashboard_server_panels_return_data(scraped: str) -> None:
    dashboard = json.loads(HEARTH_DASHBOARD.read_text())
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expression = target.get("expr", "")
            if not expression or "hearth_router_" in expression:
                continue  # the router's panels need `hearth route` in front
            result = _query(scraped, _fill(expression.replace("=~", "=")))
            assert result, f"{panel['title']}: {expression} returned nothing"
            checked += 1
    assert checked >= 9
