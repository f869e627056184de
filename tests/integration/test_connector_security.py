"""The connector's security options on vLLM's real Scheduler (tests/integration/strata_harness.py):
a store made with ``store_mode``, records authenticated with ``auth_key_file`` and refused under
another key after a restart, the start-up warning for a store others can read, and an unusable
secret refused before anything is opened (docs/SECURITY.md)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from strata_harness import G, Runner, write_model_dir

from kvstrata.config_values import ConfigError
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model"))


def _prompt(n: int) -> list[int]:
    return [(7919 + i * 104729) % 50000 + 10 for i in range(n)]


def _secret(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _serve_once(model_dir: Path, store: Path, extra: dict, prompt: list[int]) -> tuple[int, dict]:
    r = Runner([G("full", 16)], model_dir, store, extra=extra)
    try:
        served = r.serve(prompt, 1)
        assert r.load_errors == [], r.load_errors
        disk = dict(r.connector.scheduler.hierarchy.stats()["tiers"]["disk"])
    finally:
        r.close()  # a clean shutdown writes what the write-behind holds
    return served, disk


def test_a_private_store_with_authenticated_records_across_restarts(
        model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "store"
    key_a = _secret(tmp_path / "a.key", "connector-secret-A-0123456789")
    key_b = _secret(tmp_path / "b.key", "connector-secret-B-0123456789")
    prompt = _prompt(100)
    old = os.umask(0o077)  # store_mode's group bits are set whatever the umask
    try:
        assert _serve_once(model_dir, store, {"store_mode": "0750", "auth_key_file": key_a}, prompt)[0] == 0
    finally:
        os.umask(old)
    assert _mode(store) == 0o750 and _mode(store / rec.DATA_FILE) == 0o640
    with DiskStore(store, budget_bytes=1 << 30, readonly=True, create=False) as disk:
        macs = disk.read(lambda txn, h: [rec.decode_index(v).mac for _, v in txn.cursor(db=h.index)])
    assert macs and all(len(m) == 32 for m in macs)
    served, stats = _serve_once(model_dir, store, {"auth_key_file": key_a}, prompt)
    assert served == 100 and stats["forged"] == 0  # the same key: served from disk
    # Another key: refused, counted. (Verify-first loads: with streamed ones the hit is answered
    # before the records are read, and a refused record fails the load, which vLLM recomputes,
    # as it does for a corrupt one.)
    os.chmod(store / rec.DATA_FILE, 0o644)  # the start-up log says so
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        served, stats = _serve_once(model_dir, store, {"auth_key_file": key_b, "stream_loads": False}, prompt)
    assert served == 0 and stats["forged"] > 0
    assert "readable by every user" in caplog.text and rec.DATA_FILE in caplog.text
    assert _mode(store) == 0o750 and _mode(store / rec.DATA_FILE) == 0o644  # an existing store keeps its modes


def test_an_unusable_secret_is_refused_before_the_store_opens(model_dir: Path, tmp_path: Path) -> None:
    key = _secret(tmp_path / "k", "a-long-enough-secret-0123456789")
    os.chmod(key, 0o644)
    store = tmp_path / "never-opened"
    with pytest.raises(ConfigError, match="readable by every user") as exc:
        Runner([G("full", 16)], model_dir, store, extra={"auth_key_file": key})
    assert "a-long-enough-secret" not in str(exc.value)
    assert not store.exists()
