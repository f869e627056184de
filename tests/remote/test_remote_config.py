"""The shared tier's options (pure: nothing connects): every ``remote_url`` form kvstrata takes,
every bad ``remote_*`` value refused with an error naming its key, and the password kept out of
everything that may be logged."""

from __future__ import annotations

import pytest

from kvstrata.config import StrataConfig
from kvstrata.config_values import ConfigError
from kvstrata.remote_address import RemoteAddress, RemoteURLError, parse_remote_url
from kvstrata.tiers.remote import RemoteStore

SECRET = "hunter2-s3cret"


@pytest.mark.parametrize(
    ("url", "nodes", "cluster", "tls", "db", "username", "password"),
    [
        ("redis://cache", [("cache", 6379)], False, False, 0, None, None),
        ("redis://cache:6380", [("cache", 6380)], False, False, 0, None, None),
        ("redis://cache:6380/3", [("cache", 6380)], False, False, 3, None, None),
        ("redis://cache:6380/", [("cache", 6380)], False, False, 0, None, None),
        ("rediss://cache.example.com:6380/1", [("cache.example.com", 6380)], False, True, 1, None, None),
        ("valkey://10.0.0.7", [("10.0.0.7", 6379)], False, False, 0, None, None),
        ("valkeys://10.0.0.7:7000", [("10.0.0.7", 7000)], False, True, 0, None, None),
        ("REDIS://Cache:1", [("Cache", 1)], False, False, 0, None, None),  # the scheme in any case
        ("redis://[::1]:6380", [("::1", 6380)], False, False, 0, None, None),
        ("redis://[2001:db8::7]", [("2001:db8::7", 6379)], False, False, 0, None, None),
        ("redis://alice:pw@cache:1/2", [("cache", 1)], False, False, 2, "alice", "pw"),
        ("redis://:pw@cache", [("cache", 6379)], False, False, 0, None, "pw"),
        ("redis://pw@cache", [("cache", 6379)], False, False, 0, None, "pw"),  # password only
        ("redis://alice:p%40ss%3Aw@cache", [("cache", 6379)], False, False, 0, "alice", "p@ss:w"),
        ("redis://alice:a@b/c@cache", [("cache", 6379)], False, False, 0, "alice", "a@b/c"),
        ("redis+cluster://h1:7000,h2:7001", [("h1", 7000), ("h2", 7001)], True, False, 0, None, None),
        ("redis+cluster://h1", [("h1", 6379)], True, False, 0, None, None),
        ("rediss+cluster://u:pw@h1:7000,[::1]:7001", [("h1", 7000), ("::1", 7001)], True, True, 0, "u", "pw"),
        ("valkey+cluster://h1:7000,h2:7001,h3:7002", [("h1", 7000), ("h2", 7001), ("h3", 7002)],
         True, False, 0, None, None),
        ("valkeys+cluster://h1:7000", [("h1", 7000)], True, True, 0, None, None),
        ("  redis://cache  ", [("cache", 6379)], False, False, 0, None, None),  # surrounding blanks
    ],
)
def test_remote_url_forms(url, nodes, cluster, tls, db, username, password) -> None:
    a = parse_remote_url(url)
    assert a == RemoteAddress(tuple(nodes), cluster=cluster, tls=tls, db=db, username=username,
                              password=password)
    # The option takes it too, and keeps it as given (stripped).
    assert StrataConfig.from_extra_config({"remote_url": url}).remote_url == url.strip()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://cache", "unknown scheme"),
        ("redis:/cache", "unknown scheme"),
        ("cache:6379", "unknown scheme"),
        ("redis+sentinel://cache", "unknown scheme"),
        ("", "expected a redis://"),
        ("   ", "expected a redis://"),
        ("redis://", "no host"),
        ("redis:///0", "no host"),
        ("redis://cache:0", "port 0 out of range"),
        ("redis://cache:65536", "port 65536 out of range"),
        ("redis://cache:123456", "is not host"),
        ("redis://cache:-1", "is not host"),
        ("redis://cache:port", "is not host"),
        ("redis://ca che", "is not host"),
        ("redis://[::1", "is not host"),
        ("redis://::1:6379", "is not host"),  # IPv6 needs its brackets
        ("redis://cache/x", "the database must be a number"),
        ("redis://cache/-1", "the database must be a number"),
        ("redis://cache/65536", "the database must be a number"),
        ("redis://cache/\u0664", "the database must be a number"),  # a non-ASCII digit
        ("redis://h1:1,h2:2", "several hosts need a cluster URL"),
        ("redis+cluster://h1:1,h2:2/1", "a cluster has only database 0"),
        ("redis+cluster://h1:1,", "is not host"),
        ("redis://cache?socket_timeout=1", "query parameters and fragments are not supported"),
        ("redis://cache#x", "query parameters and fragments are not supported"),
    ],
)
def test_a_bad_remote_url_is_refused_naming_the_key(url: str, why: str) -> None:
    with pytest.raises(RemoteURLError, match=why):
        parse_remote_url(url)
    with pytest.raises(ConfigError, match=f"kvstrata option 'remote_url': .*{why}"):
        StrataConfig.from_extra_config({"remote_url": url})


@pytest.mark.parametrize("value", [6379, 1.5, True, b"redis://cache", ["redis://cache"], {"url": "x"}])
def test_a_remote_url_that_is_not_a_string_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="kvstrata option 'remote_url': expected a redis://"):
        StrataConfig.from_extra_config({"remote_url": value})


BAD_SECONDS = [0, -1, "0", "-0.5", "soon", "1s", "nan", "inf", float("nan"), float("inf"), 10**400,
               True, [1], "1e-400"]


@pytest.mark.parametrize("key", ["remote_timeout_s", "remote_connect_timeout_s", "remote_write_timeout_s",
                                 "remote_probe_interval_s"])
@pytest.mark.parametrize("value", [*BAD_SECONDS, None])
def test_bad_remote_seconds_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"kvstrata option '{key}': expected a positive finite number of seconds"):
        StrataConfig.from_extra_config({key: value})


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_bad_remote_ttl_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="kvstrata option 'remote_ttl_s': expected a positive finite number"):
        StrataConfig.from_extra_config({"remote_ttl_s": value})


def test_remote_timeouts_together_must_stay_short() -> None:
    with pytest.raises(ConfigError, match="'remote_connect_timeout_s' \\+ 'remote_timeout_s' exceed 10 s"):
        StrataConfig.from_extra_config({"remote_connect_timeout_s": 5, "remote_timeout_s": 5.5})
    cfg = StrataConfig.from_extra_config({"remote_connect_timeout_s": "4.5", "remote_timeout_s": 5})
    assert (cfg.remote_connect_timeout_s, cfg.remote_timeout_s) == (4.5, 5.0)


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("remote_max_connections", 0, r"must be in \[1, 1024\]"),
        ("remote_max_connections", 1025, r"must be in \[1, 1024\]"),
        ("remote_max_connections", -3, r"must be in \[1, 1024\]"),
        ("remote_max_connections", 1.5, "expected an integer"),
        ("remote_max_connections", "many", "expected an integer"),
        ("remote_max_connections", True, "expected an integer"),
        ("remote_max_connections", None, "expected an integer"),
        ("remote_admission", 0, r"must be in \[1, "),
        ("remote_admission", -1, r"must be in \[1, "),
        ("remote_admission", "some", "expected an integer"),
        ("remote_admission", "ALL", "expected an integer"),
        ("remote_admission", 2.0, "expected an integer"),
        ("remote_admission", None, "expected an integer"),
        ("remote_write_backlog_bytes", 1000, "must be at least 1048576 bytes"),
        ("remote_write_backlog_bytes", "512KiB", "must be at least 1048576 bytes"),
        ("remote_write_backlog_bytes", 0, "must be at least 1048576 bytes"),
        ("remote_write_backlog_bytes", -(1 << 20), "must not be negative"),
        ("remote_write_backlog_bytes", "lots", "expected a byte size"),
        ("remote_write_backlog_bytes", "64 parsecs", "unknown size unit"),
        ("remote_write_backlog_bytes", None, "expected a byte size"),
        ("remote_write_backlog_bytes", "2EiB", "expected a byte size|unknown size unit"),
    ],
)
def test_bad_remote_values_are_refused_naming_the_key(key: str, value: object, why: str) -> None:
    with pytest.raises(ConfigError, match=f"kvstrata option '{key}': .*(?:{why})"):
        StrataConfig.from_extra_config({key: value})


def test_remote_defaults_and_conversions() -> None:
    cfg = StrataConfig.from_extra_config({})
    assert cfg.remote_url is None and cfg.remote_ttl_s is None  # off unless configured
    # Every default passes its own validation (the numbers themselves are tuned elsewhere).
    remote = {f: getattr(cfg, f) for f in vars(cfg) if f.startswith("remote_")}
    assert {"remote_url", "remote_timeout_s", "remote_connect_timeout_s", "remote_write_timeout_s",
            "remote_probe_interval_s",
            "remote_max_connections", "remote_admission", "remote_write_backlog_bytes",
            "remote_ttl_s"} <= set(remote)
    assert StrataConfig.from_extra_config(remote) == cfg
    cfg = StrataConfig.from_extra_config({
        "remote_url": "valkey://cache:7000/2", "remote_timeout_s": "0.5", "remote_connect_timeout_s": 1,
        "remote_probe_interval_s": ".25", "remote_max_connections": "32", "remote_admission": "all",
        "remote_write_backlog_bytes": "16MiB", "remote_ttl_s": "3600", "remote_write_timeout_s": "7.5",
    })
    assert cfg.remote_url == "valkey://cache:7000/2"
    assert (cfg.remote_timeout_s, cfg.remote_connect_timeout_s, cfg.remote_probe_interval_s) == (0.5, 1.0, 0.25)
    assert (cfg.remote_max_connections, cfg.remote_admission, cfg.remote_write_timeout_s) == (32, 1, 7.5)
    assert (cfg.remote_write_backlog_bytes, cfg.remote_ttl_s) == (16 << 20, 3600.0)
    assert StrataConfig.from_extra_config({"remote_admission": 3}).remote_admission == 3
    assert StrataConfig.from_extra_config({"remote_url": None, "remote_ttl_s": None}).remote_url is None


def test_a_remote_only_stack_is_valid() -> None:
    cfg = StrataConfig.from_extra_config({"disk": False, "remote_url": "redis://cache:6379"})
    assert cfg.disk is False and cfg.remote_url == "redis://cache:6379"
    cfg = StrataConfig.from_extra_config({"disk": "false", "remote_url": "redis+cluster://a:1,b:2"})
    assert cfg.disk is False and cfg.remote_url == "redis+cluster://a:1,b:2"


def test_a_remote_store_refuses_a_codec_it_does_not_have() -> None:
    # Refused before anything connects or starts (as the disk store refuses it): a codec name
    # the frame encoder does not know would otherwise be taken for "auto".
    with pytest.raises(ValueError, match="codec must be 'auto' or 'raw', not 'zstd'"):
        RemoteStore("redis://127.0.0.1:1", codec="zstd")


def test_an_unknown_remote_option_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown kvstrata option\(s\) \['remote_urls'\]"):
        StrataConfig.from_extra_config({"remote_urls": "redis://cache"})


# ---- the password never shows -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        (f"redis://alice:{SECRET}@cache:6380/2", "redis://alice:***@cache:6380/2"),
        (f"redis://:{SECRET}@cache", "redis://:***@cache:6379"),
        (f"redis://{SECRET}@cache", "redis://:***@cache:6379"),
        (f"rediss://alice:{SECRET}@[::1]:7000", "rediss://alice:***@[::1]:7000"),
        (f"valkeys+cluster://alice:{SECRET}@h1:1,h2:2", "rediss+cluster://alice:***@h1:1,h2:2"),
        ("redis://alice@cache", "redis://:***@cache:6379"),  # a lone name is a password
        ("redis://cache:1/0", "redis://cache:1"),
        ("valkey://[::1]:6380/4", "redis://[::1]:6380/4"),
    ],
)
def test_redacted_never_shows_the_password(url: str, redacted: str) -> None:
    a = parse_remote_url(url)
    assert a.redacted() == redacted
    assert SECRET not in a.redacted() and SECRET not in repr(a) and SECRET not in str(a)
    # A store on it (nothing connects before its first call) reports only the redacted URL.
    store = RemoteStore(a)
    try:
        assert store.url == redacted and store.stats()["url"] == redacted
        assert SECRET not in repr(store.stats())
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    [
        f"redis://alice:{SECRET}@cache:99999",
        f"redis://alice:{SECRET}@ca che",
        f"redis://{SECRET}@cache/x",
        f"http://alice:{SECRET}@cache",
        f"redis://alice:{SECRET}@h1,h2",
        f"redis://alice:{SECRET}@cache?x=1",
        f"redis://cache?password={SECRET}",
        f"redis://alice:{SECRET}?x@cache",
    ],
)
def test_errors_about_a_url_never_show_its_password(url: str) -> None:
    """The message of a refused URL ends up in logs: it shows the URL with the password masked."""
    with pytest.raises(ConfigError) as err:
        StrataConfig.from_extra_config({"remote_url": url})
    assert "remote_url" in str(err.value) and SECRET not in str(err.value)
    assert "***" in str(err.value) or "?..." in str(err.value)
