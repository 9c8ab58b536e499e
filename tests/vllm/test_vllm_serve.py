"""hicache inside `vllm serve` (vLLM's OpenAI-compatible server, SmolLM2-135M), over HTTP.

One server for the module (a start takes 30+ s here), started as a user would, with the `vllm`
command of this environment and the connector in `--kv-transfer-config`; its file tier is slowed by
a fake (``SlowWriteFileBackend``) so that writes are still queued when it is told to stop. In order:

1. a completion is answered, and after vLLM's prefix cache is reset the same prompt is served from
   hicache (the blocks counted as cached) with the same greedy text;
1b. a long prompt whose first blocks vLLM holds again: hicache loads only the blocks vLLM lacks,
   straight from its host tier (no staging: its device tier is one block), none cut short, same text;
2. hicache's metrics appear on vLLM's own ``/metrics`` during traffic (through vLLM's connector
   stats), and the worker's ``metrics_port`` serves them live;
3. SIGTERM right after a burst of saves: with ``--shutdown-timeout`` and
   ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` set, the worker drains, every page promised to storage
   is a page file, and the log says so with the counts.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.bench.models import smollm2_dir
from hicache.integrations.vllm import ChannelClient, socket_path

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BLOCK = 128
ENGINE_ID = "hicache-serve-test"
START_TIMEOUT_S = 300
RNG = random.Random(11)


def _tokens(n: int) -> list[int]:
    return [RNG.randrange(100, 49000) for _ in range(n)]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    model: str
    log: Path
    pages: Path
    channel: ChannelClient

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return self.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0})

    def scrape(self, url: str | None = None) -> dict[str, Any]:
        with urllib.request.urlopen(url or self.url + "/metrics", timeout=30) as resp:
            return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}

    def stats(self) -> dict[str, Any]:
        reply = self.channel.call({"op": "stats"})
        assert reply is not None, "the worker's channel did not answer"
        return reply

    def page_files(self) -> int:
        return len(list(self.pages.rglob("*.kv")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    pages, log = tmp / "pages", tmp / "server.log"
    model = str(smollm2_dir())
    transfer = {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "engine_id": ENGINE_ID,  # names the worker's channel, so the test can ask it for stats
        "kv_connector_extra_config": {
            "config": str(REPO / "config" / "vllm.yaml"),
            "stats_interval_s": 0.2,
            "metrics_port": 0,
            "overrides": {
                "tiers": {"host": {"capacity": "128MiB", "pin_memory": False},
                          "storage": [{"kind": "tests.vllm.fakes:SlowWriteFileBackend", "name": "file",
                                       "path": str(pages), "fsync": "never", "delay_s": 1.0}]},
                "controller": {"shutdown_timeout_s": 60},
            },
        },
    }
    port = _free_port()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false", VLLM_SERVER_DEV_MODE="1",
               VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="60", HICACHE_VLLM_RUNTIME_DIR=str(tmp / "run"))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it overrides --kv-cache-memory-bytes
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])  # tests.vllm.fakes
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--kv-cache-memory-bytes", str(100 << 20), "--enforce-eager",
           "--enable-prompt-tokens-details", "--shutdown-timeout", "90", "--kv-transfer-config", json.dumps(transfer)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_VLLM_RUNTIME_DIR", env["HICACHE_VLLM_RUNTIME_DIR"])
        channel = ChannelClient(socket_path(ENGINE_ID))  # where the worker listens
    srv = Server(proc, f"http://127.0.0.1:{port}", model, log, pages, channel)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}); log tail:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(srv.url + "/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve not up after {START_TIMEOUT_S} s; log tail:\n{log.read_text()[-4000:]}")
                time.sleep(1)
        yield srv
    finally:
        srv.channel.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_vllm_serve_answers_and_serves_a_repeated_prompt_from_hicache(server: Server) -> None:
    prompt = _tokens(300)
    first = server.complete(prompt, max_tokens=6)
    assert first["usage"]["completion_tokens"] == 6
    server.channel.call({"op": "wait_idle"})
    assert server.post("/reset_prefix_cache")["success"]  # vLLM forgets; hicache keeps
    second = server.complete(prompt, max_tokens=6)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # Whole blocks before the last prompt token: 2 blocks, loaded by the connector.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    assert server.stats()["connector"]["loaded_tokens"] >= 2 * BLOCK


def test_the_worker_shortened_the_gil_switch_interval_before_the_cache_started(server: Server) -> None:
    # The default of gil_switch_interval_s (0.5 ms against CPython's 5 ms), set in vLLM's worker process.
    assert "GIL switch interval is 0.50 ms (was 5.00 ms)" in server.log.read_text()


def test_a_long_prefix_is_loaded_only_where_vllm_lacks_it_straight_from_the_host_tier(server: Server) -> None:
    doc = _tokens(6 * BLOCK + 20)
    first = server.complete(doc, max_tokens=6)  # vLLM alone computes it all; hicache saves its 6 blocks
    server.channel.call({"op": "wait_idle"})
    assert server.post("/reset_prefix_cache")["success"]
    server.complete(doc[: 2 * BLOCK + 5], max_tokens=1)  # vLLM holds the first 2 blocks again (loaded)
    before = server.stats()
    again = server.complete(doc, max_tokens=6)
    after = server.stats()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK
    c0, c1 = before["connector"], after["connector"]
    assert c1["loaded_tokens"] - c0["loaded_tokens"] == 4 * BLOCK  # the 4 blocks vLLM lacked, not all 6
    assert c1["load_failures"] == c0["load_failures"] and c1["failed_tokens"] == c0["failed_tokens"]
    h0, h1 = before["cache"]["tiers"]["host"], after["cache"]["tiers"]["host"]
    assert h1["hit_tokens"] - h0["hit_tokens"] == 4 * BLOCK  # held in place on the host tier
    assert after["cache"]["short_retrieves"] == 0
    device = after["cache"]["tiers"]["device"]
    assert device["capacity_pages"] == 1 and device["used_pages"] == 0  # nothing staged


def _value(families: dict[str, Any], name: str, **labels: str) -> float:
    family = families.get(name)
    assert family is not None, f"{name} not exported; have {sorted(k for k in families if k.startswith('hicache'))}"
    return sum(s.value for s in family.samples if s.name == name + "_total" and labels.items() <= s.labels.items())


def test_hicache_metrics_are_on_vllms_metrics_during_traffic_and_live_on_metrics_port(server: Server) -> None:
    before = _value(server.scrape(), "hicache_vllm_saved_tokens")
    prompts = [_tokens(300) for _ in range(4)]
    done = threading.Event()

    def traffic() -> None:
        try:
            for p in prompts:
                server.complete(p, max_tokens=4)
        finally:
            done.set()

    thread = threading.Thread(target=traffic)
    thread.start()
    seen: list[float] = []
    try:
        while not done.is_set():
            families = server.scrape()
            seen.append(_value(families, "hicache_vllm_saved_tokens"))
            time.sleep(0.3)
    finally:
        thread.join(timeout=300)
    assert max(seen) > before, f"vLLM's /metrics never showed the saves during traffic: {seen}"
    families = server.scrape()
    sample = next(s for s in families["hicache_vllm_saved_tokens"].samples)
    assert sample.labels["model_name"] == server.model and sample.labels["engine"] == "0"  # vLLM's labels
    for name in ("hicache_tier_used_pages", "hicache_storage_backend_call_seconds", "hicache_lookup_seconds",
                 "hicache_vllm_hook_seconds", "hicache_tier_lost_pages"):
        assert name in families, name
    # The worker's own endpoint reads the cache live: its figure is the channel's, and vLLM's lags it.
    stats = server.stats()
    live = server.scrape(stats["metrics_url"])
    assert _value(live, "hicache_vllm_saved_tokens") == stats["connector"]["saved_tokens"]
    assert _value(families, "hicache_vllm_saved_tokens") <= stats["connector"]["saved_tokens"]
    assert stats["connector"]["saved_tokens"] >= before + 4 * 2 * BLOCK


def test_sigterm_after_a_burst_of_saves_drains_every_promised_page_to_storage(server: Server) -> None:
    prompts = [_tokens(2 * BLOCK + 10) for _ in range(6)]
    threads = [threading.Thread(target=server.complete, args=(p, 1)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stats = server.stats()
    promised = stats["connector"]["saved_tokens"] // BLOCK  # write-through: every saved page is owed to storage
    # The cache's own count of pages stored, not the files on disk: a batch's files appear before its
    # count does, so a file seen here may be counted again as written while draining. The count only
    # grows, so what the drain wrote is at most what this snapshot had not counted yet.
    stored_before = stats["cache"]["storage_backups"]
    at_sigterm = server.page_files()
    server.proc.send_signal(signal.SIGTERM)
    assert at_sigterm < promised, "no write was pending at SIGTERM: the burst proves nothing"
    server.proc.wait(timeout=150)
    log = server.log.read_text()
    assert server.page_files() == promised, log[-4000:]
    drained = re.search(r"hicache: closed in [\d.]+ s: (\d+) pages written to storage while draining", log)
    assert drained is not None, log[-4000:]
    assert int(drained.group(1)) <= promised - stored_before
    assert "0 pages the write_through policy promised to storage not written" in log
