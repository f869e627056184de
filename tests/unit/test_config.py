"""Connector options: defaults, sizes, and errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.connector.config import ConfigError, StrataConfig, default_store_path, parse_size


def test_defaults_need_no_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTRATA_STORE", str(tmp_path / "s"))
    cfg = StrataConfig.from_extra_config({})
    assert cfg.store_path == tmp_path / "s"
    assert cfg.host_bytes == 1 << 30 and cfg.disk and cfg.codec == "auto" and cfg.zstd_level == 1


def test_default_store_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTRATA_STORE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert default_store_path() == Path("/x/cache/kvstrata/store")


@pytest.mark.parametrize(
    ("text", "size"),
    [(4096, 4096), ("4GiB", 4 << 30), ("512 MB", 512 * 10**6), ("1.5GiB", 3 << 29), ("2k", 2000)],
)
def test_sizes(text: object, size: int) -> None:
    assert parse_size("host_bytes", text) == size


def test_values_are_converted() -> None:
    cfg = StrataConfig.from_extra_config(
        {"store_path": "~/x", "host_bytes": "2GiB", "disk": "false", "admission": "all",
         "blocks_per_chunk": "4", "eviction": "arc", "max_age_s": 3600}
    )
    assert cfg.store_path == Path("~/x").expanduser()
    assert cfg.host_bytes == 2 << 30 and cfg.disk is False and cfg.admission == 1
    assert cfg.blocks_per_chunk == 4 and cfg.eviction == "arc" and cfg.max_age_s == 3600.0


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"host_byte": 1}, "host_byte"),
        ({"cpu_bytes_to_use": 1}, "cpu_bytes_to_use"),
        ({"host_bytes": "lots"}, "host_bytes"),
        ({"host_bytes": -5}, "host_bytes"),
        ({"host_bytes": True}, "host_bytes"),
        ({"host_bytes": 100}, "host_bytes"),
        ({"codec": "lz4"}, "codec"),
        ({"zstd_level": 0}, "zstd_level"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk"),
        ({"blocks_per_chunk": 1.5}, "blocks_per_chunk"),
        ({"disk": "maybe"}, "disk"),
        ({"store_path": ""}, "store_path"),
        ({"store_path": 3}, "store_path"),
        ({"admission": 0}, "admission"),
        ({"max_age_s": -1}, "max_age_s"),
        ({"eviction": "fifo"}, "eviction"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": "many"}, "io_threads.*auto"),
    ],
)
def test_bad_options_name_the_key(extra: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        StrataConfig.from_extra_config(extra)


@pytest.mark.parametrize(
    ("value", "policy", "streams"),
    [("auto", "recompute", True), ("auto", "fail", False), (True, "recompute", True),
     ("false", "recompute", False), (False, "fail", False)],
)
def test_stream_loads_follows_the_load_failure_policy(value: object, policy: str, streams: bool) -> None:
    cfg = StrataConfig.from_extra_config({"stream_loads": value})
    assert cfg.resolve_stream_loads(policy) is streams


def test_stream_loads_true_is_refused_when_a_failed_load_would_fail_the_request() -> None:
    cfg = StrataConfig.from_extra_config({"stream_loads": "true"})
    with pytest.raises(ConfigError, match="stream_loads.*kv_load_failure_policy.*'fail'"):
        cfg.resolve_stream_loads("fail")
    with pytest.raises(ConfigError, match="stream_loads"):
        StrataConfig.from_extra_config({"stream_loads": "sometimes"})


def test_io_threads_auto_is_one_per_usable_core_at_most_four(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstrata.connector.config as config

    cfg = StrataConfig.from_extra_config({})
    assert cfg.io_threads == "auto"
    for cores, threads in ((1, 1), (2, 2), (3, 3), (4, 4), (64, 4)):
        monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert cfg.resolve_io_threads() == threads
    # An explicit count is taken as given, whatever the cores.
    assert StrataConfig.from_extra_config({"io_threads": "6"}).resolve_io_threads() == 6


def test_switch_interval_is_only_ever_lowered() -> None:
    import sys

    from kvstrata.connector.connector import _lower_switch_interval

    before = sys.getswitchinterval()
    try:
        _lower_switch_interval(None)
        assert sys.getswitchinterval() == before
        _lower_switch_interval(before * 10)
        assert sys.getswitchinterval() == before
        _lower_switch_interval(before / 10)
        assert sys.getswitchinterval() == pytest.approx(before / 10)
    finally:
        sys.setswitchinterval(before)
    assert StrataConfig.from_extra_config({}).python_switch_interval_s == 0.0005
    assert StrataConfig.from_extra_config({"python_switch_interval_s": None}).python_switch_interval_s is None
    with pytest.raises(ConfigError, match="python_switch_interval_s"):
        StrataConfig.from_extra_config({"python_switch_interval_s": 0})


def test_self_describing_kv_events_is_an_opt_in_bool() -> None:
    assert StrataConfig.from_extra_config({}).self_describing_kv_events is False
    assert StrataConfig.from_extra_config({"self_describing_kv_events": True}).self_describing_kv_events
    with pytest.raises(ConfigError, match="self_describing_kv_events"):
        StrataConfig.from_extra_config({"self_describing_kv_events": "sometimes"})


def test_warm_start_bytes_is_a_size_within_the_host_tier() -> None:
    assert StrataConfig.from_extra_config({}).warm_start_bytes == 0
    cfg = StrataConfig.from_extra_config({"host_bytes": "1GiB", "warm_start_bytes": "512MiB"})
    assert cfg.warm_start_bytes == 512 << 20
    with pytest.raises(ConfigError, match="'warm_start_bytes'.*exceeds 'host_bytes'"):
        StrataConfig.from_extra_config({"host_bytes": "1GiB", "warm_start_bytes": "2GiB"})
    with pytest.raises(ConfigError, match="warm_start_bytes"):
        StrataConfig.from_extra_config({"warm_start_bytes": "lots"})
