"""The connector's start-up configuration under vLLM 0.32.0's real Scheduler, on CPU: options and
parallelism refused before the store opens, a session-only store under a random hash seed, the
disk reserve, a host tier its shared memory cannot hold, and the write threads' priority."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from connector_scheduler_helpers import (
    store_then_serve,
    token_prompt,
)
from strata_harness import G, Runner

pytestmark = pytest.mark.integration


def test_stream_loads_true_under_the_fail_policy_is_refused_before_the_store_opens(
        model_dir: Path, tmp_path: Path) -> None:
    from strata_harness import kv_cache_config, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstrata.config_values import ConfigError
    from kvstrata.connector.connector import StrataConnector

    store = tmp_path / "never-opened"
    cfg = vllm_config(model_dir, store, block_size=16, extra={"stream_loads": True})
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    with set_current_vllm_config(cfg), pytest.raises(ConfigError, match="stream_loads"):
        StrataConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config([G("full", 16)], 64))
    assert not store.exists()


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "prefill_context_parallel_size",
                                  "decode_context_parallel_size"])
def test_unsupported_parallelism_is_refused_naming_it(model_dir: Path, tmp_path: Path, name: str) -> None:
    """Pipeline stages and context-parallel ranks hold other layers or tokens than a TP shard:
    refused at start-up, in both roles, before the store is opened."""
    from strata_harness import kv_cache_config, vllm_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstrata.connector.connector import StrataConnector

    store = tmp_path / "never-opened"
    cfg = vllm_config(model_dir, store, block_size=16)
    setattr(cfg.parallel_config, name, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with set_current_vllm_config(cfg), pytest.raises(ValueError, match=f"{name}=2"):
            StrataConnector(cfg, role, kv_cache_config([G("full", 16)], 64))
    assert not store.exists()


def test_unknown_option_is_an_error_naming_it(model_dir: Path, tmp_path: Path) -> None:
    from kvstrata.config_values import ConfigError

    with pytest.raises(ConfigError, match="hots_bytes"):
        Runner([G("full", 16)], model_dir, tmp_path / "s", extra={"hots_bytes": 1})


def test_random_hash_seed_keeps_a_session_only_store(model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import strata_harness

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    real = strata_harness.vllm_config
    monkeypatch.setattr(strata_harness, "vllm_config", lambda *a, **k: real(*a, **{**k, "hash_algo": "xxhash"}))
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        r = Runner([G("full", 16)], model_dir, tmp_path / "s")
    try:
        assert "session-only" in caplog.text
        assert not (tmp_path / "s").exists()  # the configured persistent store is left alone
        assert r.connector.plan.persistent is False
    finally:
        r.close()


@pytest.mark.parametrize("short_of_space", [False, True])
def test_the_disk_reserve_reaches_the_store(runners, tmp_path: Path, short_of_space: bool) -> None:
    """``disk_reserve`` is the disk tier's: a reserve the file system cannot give leaves an empty
    store nothing to evict, so nothing goes to disk (counted) while the host tier still serves;
    the default reserve (1 GiB) lets the same prompt reach the disk."""
    import shutil

    extra = {"disk_reserve": shutil.disk_usage(tmp_path).free + (1 << 40)} if short_of_space else {}
    r = runners([G("full", 16)], extra=extra)
    assert store_then_serve(r, token_prompt(100)) == 100  # from the host tier either way
    hierarchy = r.connector.scheduler.hierarchy
    hierarchy.close()  # every accepted write done
    disk = hierarchy.stats()["tiers"]["disk"]
    assert disk["reserve_bytes"] == extra.get("disk_reserve", 1 << 30), disk
    # The metrics' tier figures (refreshed once a second).
    import time

    deadline = time.monotonic() + 5
    while "disk_admission_drops" not in (gauges := r.connector.scheduler.take_stats().data):
        assert time.monotonic() < deadline, gauges
        time.sleep(0.1)
    if short_of_space:
        assert disk["entries"] == 0 and disk["reserve_drops"] > 0 and disk["full_events"] == 0, disk
        # Chunks the disk refused, and the disk held to its size (empty) by the reserve.
        assert gauges["disk_admission_drops"] >= disk["reserve_drops"], gauges
        assert gauges["disk_reserve_capped"] == 1, gauges
    else:
        assert disk["entries"] > 0 and disk["reserve_drops"] == 0, disk
        assert gauges["disk_admission_drops"] == 0 and gauges["disk_reserve_capped"] == 0, gauges


def test_a_host_tier_its_shared_memory_cannot_hold_is_a_clear_error(runners, tmpfs) -> None:
    """A container's /dev/shm is 64 MiB unless it runs with --shm-size or --ipc=host: a host tier
    larger than the free space of its directory stops the engine with what to change, not with
    the file system's ENOSPC alone. Needs root for a small tmpfs (skipped otherwise)."""
    import os

    from kvstrata.config_values import ConfigError

    shm = tmpfs("8m")
    with pytest.raises(ConfigError, match=r"host tier needs 64 MiB in .*, which has [0-9]+ MiB "
                                          r"free.*--shm-size.*'host_shm_dir'.*'host_bytes'"):
        runners([G("full", 16)], extra={"host_shm_dir": str(shm), "host_bytes": "64MiB"})
    assert os.listdir(shm) == []  # nothing left behind


@pytest.mark.parametrize(("device", "idle"), [("cpu", True), ("cuda", False)])
def test_auto_priority_writes_at_idle_priority_on_cpu_engines_only(
        runners, tmp_path: Path, device: str, idle: bool) -> None:
    """``background_priority: auto``: a CPU engine's write threads yield the cores to its
    forward; an accelerator engine's keep normal priority (an idle one holding the GIL on a busy
    host stalls the engine thread: docs/BENCHMARKS.md, "Idle-priority writes on a saturated
    host"). ``write_threads: auto``: one on a CPU engine, one per usable core (at most four)
    on an accelerator's, whose prefill outruns one thread's compression; ``read_processes:
    auto``, none on a CPU engine, one per read thread on an accelerator's; ``write_processes``
    likewise, one per write thread."""
    import os
    import time

    from kvstrata.tiers.priority import thread_policy

    if thread_policy() is None or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no per-thread scheduling policies here")

    def write_threads() -> dict[int, int | None]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            if name.startswith(("kvs-write-disk", "kvs-urgent-disk")):
                out[int(tid)] = thread_policy(int(tid))
        return out

    before = set(write_threads())
    r = runners([G("full", 16)], tmp_path / device, device_type=device)
    assert store_then_serve(r, token_prompt(64)) == 64
    hierarchy = r.connector.scheduler.hierarchy
    deadline = time.monotonic() + 30
    while hierarchy.stats()["writes_completed"] < 4:
        assert time.monotonic() < deadline, hierarchy.stats()
        time.sleep(0.01)
    policies = {p for tid, p in write_threads().items() if tid not in before}
    assert policies == ({os.SCHED_IDLE} if idle else {os.SCHED_OTHER}), policies
    assert hierarchy.write_threads == (1 if device == "cpu" else min(4, len(os.sched_getaffinity(0))))
    # ``read_processes: auto``: the disk's promotions read in processes of their own off CPU
    # (an accelerator's engine core keeps a Python thread busy: docs/BENCHMARKS.md).
    assert hierarchy.read_processes == (0 if device == "cpu" else min(4, len(os.sched_getaffinity(0))))
    assert [link.slab_reads for link in hierarchy._s.links] == [device != "cpu"]  # noqa: SLF001
    # ``write_processes: auto``: the disk's writes framed in processes of their own off CPU.
    assert hierarchy.write_processes == hierarchy.write_threads * (device != "cpu")
    assert [link.slab_writes for link in hierarchy._s.links] == [device != "cpu"]  # noqa: SLF001
