"""``kvstrata gpu-check`` on a machine without a device (CI): it reports, never raises."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from kvstrata.tools import gpu_check, gpu_contract

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device answers")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_without_a_device_the_check_is_skipped_with_the_reason():
    result = gpu_check.check(_args())
    assert result["status"] == "skipped" and "no CUDA or XPU device" in result["reason"]
    assert result["_exit_code"] == 0
    assert gpu_check.check(_args("--require-gpu"))["_exit_code"] == 1


def test_the_stream_contract_reports_each_failure_by_name_instead_of_raising():
    # On the CPU the stager is the CPU one: each check fails, saying so, and the next still runs.
    result = gpu_contract.check("cpu")
    assert result["status"] == "failed"
    assert set(result) == {"status", "round_trip_pinned", "round_trip_unpinned"}
    for name in ("round_trip_pinned", "round_trip_unpinned"):
        assert not result[name]["ok"] and "CpuStager" in result[name]["error"]


def test_sections_without_vllm_are_skipped_not_failed(monkeypatch):
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    for run in (gpu_check.run_cuda_tests, gpu_check.run_demo, gpu_check.run_decode):
        out = run()
        assert out["status"] == "skipped" and "vLLM's Python package" in out["reason"]


def test_the_forward_step_measure_runs_its_jobs_to_completion_and_reports_every_field():
    from kvstrata.tiers.host import HostSlab, default_slab_path
    from kvstrata.tools.synthetic_kv import synthetic_kv

    kv = synthetic_kv(layers=2, kv_heads=1, block_tokens=4, head_size=8, blocks_per_chunk=2, chunks=2)
    slab = HostSlab(default_slab_path(f"test-steps-{os.getpid()}"), kv.shard_bytes, 2)
    slab.unlink()
    try:
        stager = kv.stager(slab)
        transfers = kv.transfers()
        out = gpu_check.forward_steps(stager, transfers, iter(range(100)), torch.cpu, "cpu", 3, size=32)
        assert set(out) == {"step_ms_alone", "step_ms_with_store", "step_ms_with_load",
                            "step_with_job_vs_alone", "step_with_job_unheld_vs_alone",
                            "job_ms_store_load", "job_ms_store_load_unheld"}
        assert all(v > 0 for v in out.values() if isinstance(v, float))
        assert all(t > 0 for k in ("job_ms_store_load", "job_ms_store_load_unheld") for t in out[k])
        assert stager.pending == 0 and stager.bytes_loaded == stager.bytes_stored > 0
        stager.close()
    finally:
        slab.close()
