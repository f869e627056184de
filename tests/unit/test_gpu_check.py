"""``kvstrata gpu-check`` on a machine without a device (CI): it reports, never raises."""

from __future__ import annotations

import argparse

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
