"""Prefill/decode disaggregation with tensor parallelism on either side, over TCP: real `hearth serve`
processes, each rank of a server sending or receiving its own shard of every page; compared with a mixed
one-rank server computing the same requests (greedy, float32).

- same sizes (prefill TP=2 -> decode TP=2) through a real `hearth route`;
- different sizes, sent by hand as the router would: prefill TP=2 -> decode TP=1 (the prefill ranks' heads
  are re-assembled) and prefill TP=1 -> decode TP=2 (each decode rank gets the heads it holds);
- pipeline parallelism (prefill PP=2 -> decode PP=2: each stage sends its layers);
- MLA (latent KV) from a TP=2 prefill into a one-rank decode server, float32 and FP8.
No transfer may fail and no prompt token may be recomputed: every answer comes from moved KV. Layouts that
cannot be re-assembled (different pipeline splits) are refused at once and recomputed, never wrong.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_pd_e2e import CASES, Router, comparable, metric, post, serve, strip_ids, wait_for_zero_pages
from tiny_models import make_tiny_model

from hearth.kv_transfer.auth import sign_instruction

SECRET = "pd-parallel-secret"
TP2 = ["--tensor-parallel-size", "2", "--dtype", "float32"]
TP1 = ["--dtype", "float32"]
PP2 = ["--pipeline-parallel-size", "2", "--dtype", "float32"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pd_parallel")
    model = make_tiny_model(root / "tiny")
    os.environ["HEARTH_KV_TRANSFER_SECRET"] = SECRET  # inherited by the servers and their ranks
    # The compiled CPU kernels load in the background and may take over mid-test: the torch paths keep
    # one rank's and two ranks' arithmetic comparable (the transfers move bytes, not arithmetic).
    os.environ["HEARTH_CPU_KERNELS"] = "0"
    servers = {
        "mixed": serve(model, root / "mixed.log", *TP1),
        "prefill_tp2": serve(model, root / "prefill_tp2.log", "--role", "prefill", *TP2),
        "decode_tp2": serve(
            model, root / "decode_tp2.log", "--role", "decode", "--kv-transfer-timeout", "20", *TP2
        ),
        "prefill_tp1": serve(model, root / "prefill_tp1.log", "--role", "prefill", *TP1),
        "decode_tp1": serve(
            model, root / "decode_tp1.log", "--role", "decode", "--kv-transfer-timeout", "20", *TP1
        ),
        "prefill_pp2": serve(model, root / "prefill_pp2.log", "--role", "prefill", *PP2),
        "decode_pp2": serve(
            model, root / "decode_pp2.log", "--role", "decode", "--kv-transfer-timeout", "20", *PP2
        ),
    }
    for server in servers.values():
        server.start()
    router = None
    try:
        for server in servers.values():
            server.wait_ready(timeout_s=900)
        router = Router([servers["prefill_tp2"].url], [servers["decode_tp2"].url], root / "router.log")
        yield {**servers, "router": router}
    finally:
        if router is not None:
            router.stop()
        for server in servers.values():
            server.stop()
        os.environ.pop("HEARTH_KV_TRANSFER_SECRET", None)
        os.environ.pop("HEARTH_CPU_KERNELS", None)


def new_transfer_id() -> str:
    return f"{random.getrandbits(128):032x}"  # as the router makes them


def pd_pair(
    prefill_url: str, decode_url: str, body: dict[str, Any], timeout_s: float = 120
) -> tuple[httpx.Response, httpx.Response]:
    """One request through a prefill and a decode server, sent by hand as the router would (its signed
    instructions: the servers follow no other)."""
    transfer_id = new_transfer_id()
    secret = SECRET.encode()
    prefill_body = {
        **body,
        "max_tokens": 1,
        "kv_transfer": {
            "role": "prefill",
            "transfer_id": transfer_id,
            "decode_url": decode_url,
            **sign_instruction(secret, "prefill", transfer_id, decode_url),
        },
    }
    decode_body = {
        **body,
        "kv_transfer": {
            "role": "decode",
            "transfer_id": transfer_id,
            "prefill_url": prefill_url,
            **sign_instruction(secret, "decode", transfer_id, prefill_url),
        },
    }

    async def both() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return await asyncio.gather(
                client.post(prefill_url + "/v1/completions", json=prefill_body),
                client.post(decode_url + "/v1/completions", json=decode_body),
            )

    return asyncio.run(both())


def no_failures(decode_url: str) -> None:
    assert metric(decode_url, "hearth_kv_transfer_failures_total") == 0
    assert metric(decode_url, "hearth_kv_recomputed_tokens_total") == 0


def test_tp2_prefill_to_tp2_decode_through_the_router_answers_like_one_rank(
    deployment: dict[str, Any],
) -> None:
    mixed, router, decode = deployment["mixed"], deployment["router"], deployment["decode_tp2"]
    assert httpx.get(decode.url + "/kv_transfer/endpoint").json()["endpoint"].endswith(";tp2pp1")
    before = metric(decode.url, "hearth_kv_transfer_pages_total")
    for path, extra in CASES[:4]:
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}
        assert strip_ids(comparable(post(router.url, path, body))) == strip_ids(
            comparable(post(mixed.url, path, body))
        ), (path, extra)
    assert metric(decode.url, "hearth_kv_transfer_pages_total") > before
    no_failures(decode.url)
    wait_for_zero_pages([deployment["prefill_tp2"].url, decode.url])


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [("prefill_tp2", "decode_tp1"), ("prefill_tp1", "decode_tp2")],
    ids=["2to1", "1to2"],
)
def test_different_tp_sizes_reassemble_the_heads(
    deployment: dict[str, Any], prefill: str, decode: str
) -> None:
    prefill_url, decode_url, mixed = deployment[prefill].url, deployment[decode].url, deployment["mixed"]
    body = {"prompt": f"Shards of the {prefill} prompt travel far " * 9, "max_tokens": 8, "temperature": 0}
    want = post(mixed.url, "/v1/completions", body)
    before = metric(decode_url, "hearth_kv_transfer_pages_total")
    prefill_answer, decode_answer = pd_pair(prefill_url, decode_url, body)
    assert prefill_answer.status_code == decode_answer.status_code == 200, decode_answer.text
    assert prefill_answer.json()["kv_transfer"]["status"] == "sent"
    assert decode_answer.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert metric(decode_url, "hearth_kv_transfer_pages_total") > before
    no_failures(decode_url)
    wait_for_zero_pages([prefill_url, decode_url])


# ---- MLA (a tiny DeepseekV3-shaped checkpoint: latent KV, MoE) with an FP8 decode pool ----------------


@pytest.fixture(scope="module")
def mla_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pd_mla")
    model = make_tiny_model(root / "tiny_mla", "deepseek_v3")
    os.environ["HEARTH_KV_TRANSFER_SECRET"] = SECRET
    os.environ["HEARTH_CPU_KERNELS"] = "0"
    fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
    decode = ["--role", "decode", "--kv-transfer-timeout", "20"]
    servers = {
        "mixed": serve(model, root / "mixed.log", *TP1),
        "mixed_fp8": serve(model, root / "mixed_fp8.log", *TP1, *fp8),
        "prefill_tp2": serve(model, root / "prefill_tp2.log", "--role", "prefill", *TP2),
        "decode_tp1": serve(model, root / "decode_tp1.log", *decode, *TP1),
        "decode_fp8": serve(model, root / "decode_fp8.log", *decode, *TP1, *fp8),
    }
    for server in servers.values():
        server.start()
    try:
        for server in servers.values():
            server.wait_ready(timeout_s=900)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        os.environ.pop("HEARTH_KV_TRANSFER_SECRET", None)
        os.environ.pop("HEARTH_CPU_KERNELS", None)


def pd_complete(prefill_url: str, decode_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request through a prefill and a decode server, sent by hand as the router would."""
    prefill_answer, decode_answer = pd_pair(prefill_url, decode_url, body, timeout_s=300)
    assert prefill_answer.status_code == decode_answer.status_code == 200, decode_answer.text
    assert prefill_answer.json()["kv_transfer"]["status"] == "sent"
    return decode_answer.json()


MLA_PROMPTS = [f"Latent pages number {i} cross the wire " * (4 + i) for i in range(4)]


def test_mla_latent_from_tp2_prefill_to_one_rank_decode_is_exact(mla_deployment: dict[str, Any]) -> None:
    prefill, decode, mixed = (
        mla_deployment["prefill_tp2"],
        mla_deployment["decode_tp1"],
        mla_deployment["mixed"],
    )
    for prompt in MLA_PROMPTS:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        got = pd_complete(prefill.url, decode.url, body)
        assert got["choices"][0]["text"] == post(mixed.url, "/v1/completions", body)["choices"][0]["text"]
    assert metric(decode.url, "hearth_kv_transfer_pages_total") > 0
    no_failures(decode.url)


def test_mla_latent_converted_into_an_fp8_decode_pool(mla_deployment: dict[str, Any]) -> None:
    """A float32 latent from a TP=2 prefill server, quantized by the decode server with its own scale.
    PD and an FP8 mixed server compute the prompt's latent differently (float32 then quantized, vs
    quantized as each chunk is written), so the first answer token (computed straight from the moved
    KV) is compared, with its probability."""
    prefill, decode, mixed = (
        mla_deployment["prefill_tp2"],
        mla_deployment["decode_fp8"],
        mla_deployment["mixed_fp8"],
    )
    agree = 0
    for prompt in MLA_PROMPTS:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1}
        got = pd_complete(prefill.url, decode.url, body)["choices"][0]["logprobs"]
        want = post(mixed.url, "/v1/completions", body)["choices"][0]["logprobs"]
        if got["tokens"] == want["tokens"]:
            agree += 1
            assert abs(got["token_logprobs"][0] - want["token_logprobs"][0]) < 0.1
    assert agree >= len(MLA_PROMPTS) - 1, agree
    assert metric(decode.url, "hearth_kv_transfer_pages_total") > 0
    no_failures(decode.url)


def test_pp2_prefill_to_pp2_decode_each_stage_sends_its_layers(deployment: dict[str, Any]) -> None:
    prefill_url, decode_url, mixed = (
        deployment["prefill_pp2"].url,
        deployment["decode_pp2"].url,
        deployment["mixed"],
    )
    body = {"prompt": "Stages hand their layers over " * 10, "max_tokens": 8, "temperature": 0}
    got = pd_complete(prefill_url, decode_url, body)
    assert got["choices"][0]["text"] == post(mixed.url, "/v1/completions", body)["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(decode_url, "hearth_kv_transfer_pages_total") > 0
    no_failures(decode_url)


def test_different_pipeline_layouts_recompute_never_a_wrong_token(deployment: dict[str, Any]) -> None:
    """Prefill PP=2 -> decode TP=2 cannot be re-assembled: the send is refused at once, the decode server
    recomputes the prompt, and the answer is still one rank's."""
    prefill_url, decode_url, mixed = (
        deployment["prefill_pp2"].url,
        deployment["decode_tp2"].url,
        deployment["mixed"],
    )
    failures = metric(decode_url, "hearth_kv_transfer_failures_total")
    body = {"prompt": "Mismatched layouts are recomputed " * 8, "max_tokens": 8, "temperature": 0}
    prefill_answer, decode_answer = pd_pair(prefill_url, decode_url, body)
    assert prefill_answer.status_code == decode_answer.status_code == 200, decode_answer.text
    assert prefill_answer.json()["kv_transfer"]["status"] == "failed"
    assert (
        decode_answer.json()["choices"][0]["text"]
        == post(mixed.url, "/v1/completions", body)["choices"][0]["text"]
    )
    assert metric(decode_url, "hearth_kv_transfer_failures_total") == failures + 1
    assert metric(decode_url, "hearth_kv_recomputed_tokens_total") > 0
    wait_for_zero_pages([prefill_url, decode_url])
