"""Stores, lock files and archives are owner-only by default (a KV cache holds every prompt it
served); ``store_mode`` shares them with a group; an existing store keeps its modes; ``verify``
and the connector's start-up warn when other users can read a store (docs/SECURITY.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.config import StrataConfig
from kvstrata.config_values import ConfigError
from kvstrata.fsmode import warn_if_readable
from kvstrata.tiers import records as rec
from kvstrata.tiers.disk import DiskStore
from kvstrata.tools.cli import main

KEY = bytes(16) + bytes(range(32)) + bytes(4)
STORE_FILES = (rec.DATA_FILE, rec.LMDB_LOCK_FILE, rec.LOCK_FILE)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def fill(path: Path, **kw: object) -> None:
    with DiskStore(path, budget_bytes=1 << 30, **kw) as store:  # type: ignore[arg-type]
        assert store.put_many([(KEY, bytes(range(256)) * 64, "uint8")]) == 1


def test_a_new_store_is_owner_only_under_a_permissive_umask(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "store"
    with umask(0o022):
        fill(path)
    assert mode(path) == 0o700
    assert mode(path.parent) == 0o700  # the parents it made too
    for name in STORE_FILES:
        assert mode(path / name) == 0o600, name


def test_store_mode_shares_a_new_store_with_the_group_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with umask(0o077):  # would strip the group bits store_mode asks for
        fill(path, mode=0o750)
    assert mode(path) == 0o750
    for name in STORE_FILES:
        assert mode(path / name) == 0o640, name


def test_an_existing_store_keeps_its_modes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    fill(path)
    os.chmod(path, 0o755)
    for name in STORE_FILES:
        os.chmod(path / name, 0o644)
    fill(path)  # reopened with the default (owner-only) mode
    assert mode(path) == 0o755
    assert all(mode(path / name) == 0o644 for name in STORE_FILES)
    # A file the store recreates (the lock table a compaction removes) takes the data file's mode.
    os.chmod(path / rec.DATA_FILE, 0o640)
    (path / rec.LMDB_LOCK_FILE).unlink()
    fill(path)
    assert mode(path / rec.LMDB_LOCK_FILE) == 0o640


def test_an_export_archive_is_owner_only(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store)
    archive = tmp_path / "store.kva"
    with umask(0o022):
        assert main(["export", str(store), str(archive), "--json"]) == 0
    assert mode(archive) == 0o600
    imported = tmp_path / "imported"
    with umask(0o022):
        assert main(["import", str(archive), str(imported), "--json"]) == 0
    assert mode(imported) == 0o700 and mode(imported / rec.DATA_FILE) == 0o600


def test_verify_warns_when_others_can_read_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "store"
    fill(path)
    assert main(["verify", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["readable_by_others"] == [] and "warning" not in out.err
    os.chmod(path, 0o755)
    os.chmod(path / rec.DATA_FILE, 0o644)
    assert main(["verify", str(path), "--json"]) == 0  # a warning, not damage
    out = capsys.readouterr()
    exposed = json.loads(out.out)["readable_by_others"]
    assert len(exposed) == 2 and any(rec.DATA_FILE in line for line in exposed)
    assert "readable by every user" in out.err and "kvstrata verify: warning" in out.err


def test_the_connector_warns_at_start_up_when_others_can_read_the_store(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "store"
    fill(path)
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        assert warn_if_readable(path, logging.getLogger("kvstrata")) == []
        os.chmod(path / rec.DATA_FILE, 0o644)
        assert len(warn_if_readable(path, logging.getLogger("kvstrata"))) == 1
    assert "readable by every user" in caplog.text and rec.DATA_FILE in caplog.text


@pytest.mark.parametrize(("value", "expected"), [("0750", 0o750), ("750", 0o750), ("0o700", 0o700), (0o750, 0o750)])
def test_store_mode_option(value: object, expected: int) -> None:
    assert StrataConfig.from_extra_config({"store_mode": value}).store_mode == expected
    assert StrataConfig.from_extra_config({}).store_mode == 0o700


@pytest.mark.parametrize(("value", "why"), [("0777", "writable by every user"), ("0600", "rwx"),
                                             ("rwx", "octal"), (True, "octal"), ("01750", "octal")])
def test_a_bad_store_mode_is_refused_naming_the_option(value: object, why: str) -> None:
    with pytest.raises(ConfigError, match=f"store_mode.*{why}"):
        StrataConfig.from_extra_config({"store_mode": value})
