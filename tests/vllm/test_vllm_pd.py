"""Prefill/decode disaggregation with two `vllm serve` processes, hicache between them, SmolLM2-135M.

A prefill server (``kv_role: kv_both``) and a decode server (``kv_consumer``) share a real Valkey
on loopback as the tier the KV crosses through; ``hicache pd-proxy`` runs in front of them as a
user runs it. The servers start side by side once for the module (a start takes 30+ s here), with
the same ``VLLM_CPU_NUM_OF_RESERVED_CPU``. Every prompt is ``k * 128 + 1`` tokens, so a decode
server that receives the prompt's whole blocks computes exactly one token of it. In order:

1. through the proxy (plain and streamed), greedy outputs are those of one server alone, and the
   decode server's metrics show the prompt loaded: one token computed per request, the rest
   arrived from the prefill server (``p2p``);
2. the shared tier flushed between prefill and decode: the decode server waits out its
   ``receive_timeout_s`` and recomputes; the same output;
3. a hand-off whose check is not the decode server's namespace is refused at once and computed;
4. the prefill server killed (SIGKILL) after its prefill: the decode still completes, from Valkey.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.bench.models import smollm2_dir
from hicache.bench.vllm_server import ProxyProcess, VllmServer

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128
RECEIVE_TIMEOUT_S = 3.0
OUTPUT = 8
RNG = random.Random(24)
PROMPTS = {name: [RNG.randrange(100, 49000) for _ in range(blocks * BLOCK + 1)]
           for name, blocks in (("a", 2), ("b", 3), ("stream", 2), ("flushed", 2), ("foreign", 2), ("killed", 3))}


@dataclass
class PD:
    prefill: VllmServer
    decode: VllmServer
    proxy: ProxyProcess
    valkey_port: int
    refs: dict[str, str]  # greedy text of each prompt, one server alone

    @property
    def model(self) -> str:
        return self.decode.model

    def body(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, **extra}

    def stats(self, server: VllmServer) -> dict[str, Any]:
        reply = server.channel_call({"op": "stats"})
        assert reply is not None, f"{server.name}'s connector did not answer"
        return reply["connector"]

    def prefill_only(self, prompt: list[int]) -> dict[str, Any]:
        """The proxy's first step, by hand: the producer's kv_transfer_params once its pages are durable."""
        sends = self.stats(self.prefill)["pd_sends"]
        answer = self.prefill.post("/v1/completions", self.body(prompt, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False}))
        params = answer["kv_transfer_params"]
        assert params["hicache"]["tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
        assert len(params["hicache"]["id"]) == 16  # names the marker left if the send fails (handoff.py)
        assert params["hicache"]["pulse_s"] == 1.0  # the producer pulses while it sends; silence ends the wait
        deadline = time.monotonic() + 30
        while self.stats(self.prefill)["pd_sends"] == sends:  # reported sent: durable in Valkey
            assert time.monotonic() < deadline, "the hand-off was not made durable"
            time.sleep(0.05)
        return params


def _transfer(role: str, engine_id: str, valkey_port: int) -> dict[str, Any]:
    return {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "config": str(REPO / "config" / "vllm-pd.yaml"),
            "pd": {"receive_timeout_s": RECEIVE_TIMEOUT_S, "send_timeout_s": 30},
            "overrides": {"tiers": {
                "host": {"capacity": "64MiB", "pin_memory": False, "prefault": False},
                "storage": [{"kind": "redis", "name": "valkey", "url": f"redis://127.0.0.1:{valkey_port}/0",
                             "key_prefix": "pd-test"}],
            }},
        },
    }


def _server(
    name: str, role: str, valkey_port: int, tmp: Path, *, model: Path | None = None, kv_cache_bytes: int = 100 << 20
) -> VllmServer:
    """One ``vllm serve`` of ``model`` (SmolLM2 when not given) with the hicache connector in ``role``."""
    engine_id = f"hicache-pd-test-{name}-{os.getpid()}"
    args = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--enforce-eager", "--seed", "0", "--enable-prompt-tokens-details", "--shutdown-timeout", "30",
            "--disable-uvicorn-access-log", "--kv-transfer-config", json.dumps(_transfer(role, engine_id, valkey_port))]
    env = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",  # the same on both servers (see docs/engines/vllm.md, "Cores")
           "HICACHE_VLLM_RUNTIME_DIR": os.environ["HICACHE_VLLM_RUNTIME_DIR"],
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    return VllmServer(name=name, model=str(model or smollm2_dir()), args=args, log=tmp / f"{name}.log", env=env,
                      engine_id=engine_id, start_timeout_s=300)


@contextmanager
def pd_servers(tmp: Path, valkey_port: int, prompts: dict[str, list[int]], **server: Any) -> Iterator[PD]:
    """A prefill and a decode server of ``server``'s model, the proxy in front, each prompt's
    greedy text from the decode server alone (its prefix cache reset after)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp / "run"))
        prefill = _server("prefill", "kv_both", valkey_port, tmp, **server)
        decode = _server("decode", "kv_consumer", valkey_port, tmp, **server)
        proxy = ProxyProcess([], [], tmp / "proxy.log")
        try:
            prefill.launch()
            decode.launch()
            prefill.wait_ready()
            decode.wait_ready()
            proxy.prefill, proxy.decode = [prefill.url], [decode.url]
            proxy.start()
            state = PD(prefill, decode, proxy, valkey_port, {})
            for name, prompt in prompts.items():  # one server alone: the decode server, before any hand-off
                state.refs[name] = decode.post("/v1/completions", state.body(prompt))["choices"][0]["text"]
            assert decode.post("/reset_prefix_cache")["success"]  # it computes them again from here
            yield state
        finally:
            proxy.stop()
            decode.stop()
            prefill.stop()


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, valkey: Any) -> Iterator[PD]:
    with pd_servers(tmp_path_factory.mktemp("pd"), valkey.port, PROMPTS) as state:
        yield state


def _by_source(server: VllmServer) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(server.scrape())}
    family = families["vllm:prompt_tokens_by_source"]
    return {s.labels["source"]: s.value for s in family.samples if s.name.endswith("_total")}


def _stream_text(url: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def check_through_the_proxy(pd: PD, prompts: dict[str, list[int]], plain: list[str], streamed: str) -> None:
    """``plain`` prompts and one ``streamed`` through the proxy: the outputs are one server's, and
    the decode server computes the last token of each, the rest arrived from the prefill server."""
    before, received = _by_source(pd.decode), pd.stats(pd.decode)
    for name in plain:
        answer = urllib.request.urlopen(urllib.request.Request(
            pd.proxy.url + "/v1/completions", data=json.dumps(pd.body(prompts[name])).encode(),
            headers={"Content-Type": "application/json"}), timeout=180)
        assert json.loads(answer.read())["choices"][0]["text"] == pd.refs[name], name
    assert _stream_text(pd.proxy.url, pd.body(prompts[streamed])) == pd.refs[streamed]
    after, now = _by_source(pd.decode), pd.stats(pd.decode)
    names = [*plain, streamed]
    assert after["local_compute"] - before["local_compute"] == len(names)  # the last token of each prompt
    arrived = sum(len(prompts[n]) - 1 for n in names)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == arrived
    assert now["pd_receives"] - received["pd_receives"] == len(names)
    assert now["pd_received_tokens"] - received["pd_received_tokens"] == arrived
    assert now["pd_receive_failures"] == received["pd_receive_failures"]
    assert pd.proxy.health()["prefill_without_kv"] == 0
    sent = pd.stats(pd.prefill)
    assert sent["pd_sends"] >= len(names) and sent["pd_send_failures"] == 0


def test_through_the_proxy_outputs_are_one_servers_and_the_decode_server_computes_one_token_a_prompt(pd: PD) -> None:
    check_through_the_proxy(pd, PROMPTS, ["a", "b"], "stream")


def test_the_shared_tier_flushed_between_prefill_and_decode_is_recomputed_with_the_same_output(pd: PD) -> None:
    import redis

    prompt = PROMPTS["flushed"]
    params = pd.prefill_only(prompt)
    redis.Redis(port=pd.valkey_port).flushall()  # the tier lost the prompt's pages
    before, received = _by_source(pd.decode), pd.stats(pd.decode)
    started = time.monotonic()
    answer = pd.decode.post("/v1/completions", pd.body(prompt, kv_transfer_params=params))
    assert answer["choices"][0]["text"] == pd.refs["flushed"]
    assert time.monotonic() - started >= RECEIVE_TIMEOUT_S * 0.9  # it waited its bound, then computed
    after, now = _by_source(pd.decode), pd.stats(pd.decode)
    assert after["local_compute"] - before["local_compute"] == len(prompt)
    assert now["pd_receive_failures"] - received["pd_receive_failures"] == 1


def test_a_hand_off_of_another_namespace_is_refused_at_once_and_computed(pd: PD) -> None:
    prompt = PROMPTS["foreign"]
    params = pd.prefill_only(prompt)
    params["hicache"]["checks"] = ["0" * 32]  # what a producer of other weights, tenant or page size sends
    received = pd.stats(pd.decode)
    started = time.monotonic()
    answer = pd.decode.post("/v1/completions", pd.body(prompt, kv_transfer_params=params))
    assert answer["choices"][0]["text"] == pd.refs["foreign"]
    assert time.monotonic() - started < RECEIVE_TIMEOUT_S  # not waited for
    now = pd.stats(pd.decode)
    assert now["pd_receives_refused"] - received["pd_receives_refused"] == 1
    assert now["pd_received_tokens"] == received["pd_received_tokens"]


def test_the_prefill_server_killed_after_its_prefill_the_decode_still_completes(pd: PD) -> None:
    prompt = PROMPTS["killed"]
    params = pd.prefill_only(prompt)
    pd.prefill.kill()  # SIGKILL: nothing drains, nothing says goodbye; the pages are in Valkey
    received = pd.stats(pd.decode)
    answer = pd.decode.post("/v1/completions", pd.body(prompt, kv_transfer_params=params))
    assert answer["choices"][0]["text"] == pd.refs["killed"]
    now = pd.stats(pd.decode)
    assert now["pd_receives"] - received["pd_receives"] == 1
    assert now["pd_received_tokens"] - received["pd_received_tokens"] == len(prompt) - 1
