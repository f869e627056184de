"""Reaching a protected server for real: a redis-server with ``requirepass`` and an ACL user
allowed only ``kvstrata:*`` keys, and a TLS-only redis-server whose certificate a CA made here
with ``openssl`` signed (``rediss://`` with CA verification; a server the CA did not sign is
refused with a message that says so, and serving goes on from the local tiers). Passwords and
auth keys come from files or the environment, never from the JSON config vLLM logs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from redis_server import PATIENT_TIMEOUTS, PasswordRedisServer, TLSRedisServer, make_ca

from kvstrata.auth import REMOTE_AUTH_KEY_ENV, REMOTE_PASSWORD_ENV, read_secrets
from kvstrata.config import StrataConfig
from kvstrata.config_values import ConfigError
from kvstrata.presence import Presence
from kvstrata.tiers.disk import DiskStore
from kvstrata.tiers.hierarchy import Hierarchy
from kvstrata.tiers.host import HostPool, HostSlab
from kvstrata.tiers.remote import RemoteStore

KEY = b"rank0-namespace!" + bytes(range(32)) + bytes(4)
SHARD = 4096
OPTS = dict(PATIENT_TIMEOUTS, probe_interval_s=0.2)


def data(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SHARD, dtype=np.uint8)


def round_trip(store: RemoteStore) -> bool:
    if store.put_many([(KEY, data(), "uint8")]) != 1:
        return False
    out = np.zeros(SHARD, np.uint8)
    return store.get_into(KEY, out) == SHARD and np.array_equal(out, data())


@pytest.fixture
def pw_server(tmp_path: Path) -> Iterator[PasswordRedisServer]:
    server = PasswordRedisServer(tmp_path / "redis-pw")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TLSRedisServer]:
    server = TLSRedisServer(tmp_path / "redis-tls")
    try:
        yield server
    finally:
        server.stop()


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_an_acl_user_with_its_password_from_a_file_reaches_only_kvstrata_keys(
        pw_server: PasswordRedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"redis://kvstrata@127.0.0.1:{pw_server.port}/0"  # the user name only
    pw_file = secret_file(tmp_path / "redis.pw", pw_server.USER_PASSWORD)
    cfg = StrataConfig.from_extra_config({"remote_url": url, "remote_password_file": str(pw_file)})
    assert pw_server.USER_PASSWORD not in repr(cfg)
    _, _, password = read_secrets(cfg)
    assert password == pw_server.USER_PASSWORD
    store = RemoteStore(url, password=password, **OPTS)  # type: ignore[arg-type]
    try:
        assert round_trip(store) and store.stats()["errors"] == 0
        assert pw_server.USER_PASSWORD not in str(store.stats())
    finally:
        store.close()
    # The ACL is real: the same user cannot write outside kvstrata:* (a refused command is a
    # counted miss, never an exception), and a wrong password is no connection at all.
    outside = RemoteStore(url, password=password, key_prefix=b"other:", **OPTS)  # type: ignore[arg-type]
    try:
        assert outside.put_many([(KEY, data(), "uint8")]) == 0 and outside.stats()["errors"] == 1
    finally:
        outside.close()
    wrong = RemoteStore(url, password="not-the-password", **OPTS)  # type: ignore[arg-type]
    try:
        assert not round_trip(wrong) and "AuthenticationError" in str(wrong.stats()["last_error"])
    finally:
        wrong.close()
    # The environment works as well as a file.
    monkeypatch.setenv(REMOTE_PASSWORD_ENV, pw_server.USER_PASSWORD)
    assert read_secrets(StrataConfig.from_extra_config({"remote_url": url}))[2] == pw_server.USER_PASSWORD


def test_a_password_in_two_places_or_an_unsafe_secret_file_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pw_file = secret_file(tmp_path / "pw", "a-password")
    with pytest.raises(ConfigError, match="both give a password"):
        StrataConfig.from_extra_config({"remote_url": "redis://u:inline@h:1/0", "remote_password_file": str(pw_file)})
    monkeypatch.setenv(REMOTE_PASSWORD_ENV, "a-password")
    with pytest.raises(ConfigError, match="holds a password"):
        read_secrets(StrataConfig.from_extra_config({"remote_url": "redis://u:inline@h:1/0"}))
    monkeypatch.delenv(REMOTE_PASSWORD_ENV)
    key_file = secret_file(tmp_path / "key", "k" * 40)
    key_file.chmod(0o644)
    cfg = StrataConfig.from_extra_config({"remote_url": "redis://h:1/0", "remote_auth_key_file": str(key_file)})
    with pytest.raises(ConfigError, match="readable by every user") as exc:
        read_secrets(cfg)
    assert "k" * 16 not in str(exc.value)
    monkeypatch.setenv(REMOTE_AUTH_KEY_ENV, "short")
    with pytest.raises(ConfigError, match=f"{REMOTE_AUTH_KEY_ENV}.*at least 16 bytes"):
        read_secrets(StrataConfig.from_extra_config({"remote_url": "redis://h:1/0"}))
    monkeypatch.setenv(REMOTE_AUTH_KEY_ENV, "s" * 32)
    disk_auth, remote_auth, _ = read_secrets(StrataConfig.from_extra_config({"remote_url": "redis://h:1/0"}))
    assert disk_auth is None and remote_auth is not None and "s" * 16 not in repr(remote_auth)
    with pytest.raises(ConfigError, match="auth_key_file.*path of a file, got a int") as exc:
        StrataConfig.from_extra_config({"auth_key_file": 9081726354})  # never echoed back
    assert "9081726354" not in str(exc.value)
    with pytest.raises(ConfigError, match="remote_tls_ca_file.*not a TLS URL"):
        StrataConfig.from_extra_config({"remote_url": "redis://h:1/0", "remote_tls_ca_file": str(key_file)})


def test_tls_with_the_servers_ca_verifies_and_serves(tls_server: TLSRedisServer) -> None:
    assert tls_server.url.startswith("rediss://")
    store = RemoteStore(tls_server.url, tls_ca_file=str(tls_server.ca), **OPTS)  # type: ignore[arg-type]
    try:
        assert round_trip(store) and store.available
    finally:
        store.close()


def test_a_server_another_ca_signed_is_refused_clearly_and_the_local_tiers_serve(
        tls_server: TLSRedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other_ca, _, _ = make_ca(tmp_path / "other-pki", "other")
    remote = RemoteStore(tls_server.url, tls_ca_file=str(other_ca), **OPTS)  # type: ignore[arg-type]
    disk = DiskStore(tmp_path / "disk", budget_bytes=1 << 30)
    slab = HostSlab(tmp_path / "slab", SHARD, 4)
    h = Hierarchy(HostPool(slab), [disk, remote], namespaces=[KEY[:16]], group_shard_bytes=[SHARD],
                  group_dtypes=["uint8"], write_backpressure=["defer", "drop"], idle_writes=False)
    try:
        assert disk.put_many([(KEY, data(), "uint8")]) == 1  # what an earlier run left on disk
        chunk, absent = KEY[16:], bytes(32) + bytes(4)
        with caplog.at_level(logging.WARNING):
            assert h.lookup_many([absent]) == [Presence.MISS]  # asks the server: refused
            assert not remote.available
            found = h.lookup_many([chunk])
            for _ in range(2000):
                if found[0] != Presence.PENDING:
                    break
                h.wait_promotions([chunk], 0.01)
                found = h.lookup_many([chunk])
        assert found == [Presence.HIT]
        slots = h.prepare_load([chunk])
        try:
            assert np.array_equal(slab.array[slots[0], :SHARD], data())
        finally:
            h.complete_load([chunk])
        assert "CERTIFICATE_VERIFY_FAILED" in str(remote.stats()["last_error"])
        assert "not signed by a CA this replica trusts" in caplog.text
        assert "serving from the local tiers" in caplog.text
    finally:
        h.close()
        for obj in (remote, disk, slab):
            obj.close()


def test_the_system_cas_do_not_trust_a_private_ca(tls_server: TLSRedisServer) -> None:
    """Without remote_tls_ca_file the server's certificate is checked against the system's
    CAs: a private CA's is refused (verification is on by default, never skipped)."""
    store = RemoteStore(tls_server.url, **OPTS)  # type: ignore[arg-type]
    try:
        assert not round_trip(store) and "CERTIFICATE_VERIFY_FAILED" in str(store.stats()["last_error"])
    finally:
        store.close()
