"""The configurations ``kvstrata bench serve`` compares, each as the servers (and helpers: Redis,
LMCache's server) it starts. Every configuration gets the same model, engine settings and
workload; those with a host tier get the same host bytes (``--host-bytes``)."""

from __future__ import annotations

import contextlib
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.bench.peers import (
    LMCacheServer,
    PeerUnavailable,
    default_lmcache_venv,
    ensure_lmcache_venv,
    vllm_offload_config,
)
from kvstrata.bench.server import ServerSpec, free_port
from kvstrata.tools.engine import strata_transfer_config

CONFIGS: dict[str, str] = {
    "vllm": "vLLM alone (its device prefix cache only)",
    "vllm_cpu_offload": "vLLM's OffloadingConnector, CPU tier of --host-bytes",
    "vllm_tiered_fs": "vLLM's OffloadingConnector, CPU tier + fs tier (TieringOffloadingSpec)",
    "kvstrata": "kvstrata defaults (host tier of --host-bytes + disk)",
    "kvstrata_host_only": "kvstrata with the host tier only (disk off)",
    "two_replicas_redis": "two kvstrata replicas, round-robin, sharing a Redis tier",
    "two_replicas": "the same two replicas without the shared tier",
    "lmcache": "LMCache 0.5.6 multiprocess server (L1 DRAM + fs_native) + LMCacheMPConnector",
}


@dataclass
class BaseSettings:
    """What every configuration's servers share."""

    model: str
    kv_cache_bytes: int
    host_bytes: int
    max_model_len: int
    max_num_seqs: int
    dtype: str | None = None
    skip_tokenizer_init: bool = False
    lmcache_venv: Path | None = None
    # More kvstrata options for every kvstrata configuration (``--kvstrata-config``).
    kvstrata_options: dict[str, Any] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    say: Callable[[str], None] = lambda msg: None

    def strata(self, store: Path | None, **more: Any) -> dict[str, Any]:
        """kvstrata's ``kv_transfer_config``: ``--host-bytes``, then ``--kvstrata-config`` (which
        may set kvstrata's own ``host_bytes``; the peers keep ``--host-bytes``), then ``more``."""
        return strata_transfer_config(store, **{"host_bytes": self.host_bytes,
                                                **self.kvstrata_options, **more})

    def spec(self, kv: dict[str, Any] | None, env: dict[str, str] | None = None,
             python: str | None = None) -> ServerSpec:
        spec = ServerSpec(model=self.model, kv_cache_bytes=self.kv_cache_bytes,
                          max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                          dtype=self.dtype, kv_transfer_config=kv,
                          skip_tokenizer_init=self.skip_tokenizer_init,
                          env={**self.extra_env, **(env or {})})
        if python is not None:
            spec.python = python
        return spec


@dataclass
class Setup:
    """One configuration ready to start: its servers' specs, kvstrata stores to check after the
    stop, and what to stop when it is done (Redis, LMCache's server)."""

    specs: list[ServerSpec]
    stores: list[Path] = field(default_factory=list)
    closers: list[Callable[[], Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def close(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for close in self.closers:
            with contextlib.suppress(Exception):
                result = close()
                if isinstance(result, dict):
                    out.update(result)
        return out


def build_setup(name: str, base: BaseSettings, work: Path) -> Setup:
    """The servers of configuration ``name`` in ``work`` (emptied first). Raises
    :class:`PeerUnavailable` when a peer cannot run here."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if name == "vllm":
        return Setup([base.spec(None)])
    if name in ("vllm_cpu_offload", "vllm_tiered_fs"):
        kv, env = vllm_offload_config(base.host_bytes,
                                      work / "fs" if name == "vllm_tiered_fs" else None)
        return Setup([base.spec(kv, env)])
    if name == "kvstrata":
        store = work / "store"
        return Setup([base.spec(base.strata(store))], stores=[store])
    if name == "kvstrata_host_only":
        return Setup([base.spec(base.strata(work / "store", disk=False))])
    if name in ("two_replicas", "two_replicas_redis"):
        setup = Setup([])
        remote: dict[str, Any] = {}
        if name == "two_replicas_redis":
            from kvstrata.tools.redis_local import RedisServer, RedisUnavailable

            try:
                # Room for every user's context several times over: the shared tier must not
                # evict what the other replica is about to ask for.
                redis = RedisServer(work / "redis", maxmemory_mb=max(256, base.host_bytes >> 19))
            except RedisUnavailable as exc:
                raise PeerUnavailable(str(exc)) from None
            setup.closers.append(redis.stop)
            # remote_timeout_s above the default: two engines on a loaded 2-core machine can keep
            # a lookup waiting for a core longer (tests/e2e/test_vllm_serve.py).
            remote = {"remote_url": redis.url, "remote_timeout_s": 1.0}
        for i in range(2):
            store = work / f"store_{i}"
            setup.specs.append(base.spec(base.strata(store, **remote)))
            setup.stores.append(store)
        return setup
    if name == "lmcache":
        venv = base.lmcache_venv or default_lmcache_venv()
        python = ensure_lmcache_venv(venv, base.say)
        l1_gb = base.host_bytes / (1 << 30)  # the same host bytes as the others' host tiers
        server = LMCacheServer(python, work / "lmcache_disk", l1_gb, work / "lmcache_server.log",
                               free_port(), free_port())
        setup = Setup([base.spec(server.transfer_config(), python=str(python))],
                      closers=[lambda: {"lmcache_server_clean_stop": server.stop()}],
                      notes={"lmcache_l1_bytes": base.host_bytes, "lmcache_venv": str(venv)})
        return setup
    raise PeerUnavailable(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")


def kv_bytes_per_token(model_dir: Path, dtype: str | None) -> int:
    """KV bytes one token takes in the engine (all layers, K and V), from ``config.json``."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    elem = 4 if (dtype or cfg.get("torch_dtype") or cfg.get("dtype")) == "float32" else 2
    return 2 * int(cfg["num_hidden_layers"]) * heads * head_dim * elem


def min_kv_cache_bytes(model_dir: Path, dtype: str | None, max_model_len: int) -> int:
    """vLLM refuses to start below one max-length request's KV; 128-token blocks, 10% spare."""
    per = kv_bytes_per_token(model_dir, dtype)
    return int(math.ceil(max_model_len / 128) * 128 * per * 1.1)
