"""Connector options: defaults, sizes, and errors that name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.config import StrataConfig, default_store_path
from kvstrata.config_values import ConfigError, parse_size


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
    assert StrataConfig().shutdown_write_timeout_s == 60.0
    assert StrataConfig.from_extra_config({"shutdown_write_timeout_s": None}).shutdown_write_timeout_s is None
    assert StrataConfig.from_extra_config({"shutdown_write_timeout_s": "2.5"}).shutdown_write_timeout_s == 2.5


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
        ({"shutdown_write_timeout_s": 0}, "shutdown_write_timeout_s"),
        ({"shutdown_write_timeout_s": "soon"}, "shutdown_write_timeout_s"),
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


@pytest.mark.parametrize(
    ("value", "device", "groups", "sync"),
    [("auto", "cpu", 1, True), ("auto", "cuda", 1, False), ("auto", "xpu", 1, False),
     (True, "cuda", 1, True), ("true", "cpu", 1, True), (False, "cpu", 1, False),
     ("auto", "cpu", 2, False), (True, "cpu", 3, False)],
)
def test_sync_loads_on_cpu_engines_with_one_kv_cache_group(
        value: object, device: str, groups: int, sync: bool) -> None:
    cfg = StrataConfig.from_extra_config({"sync_loads": value})
    assert cfg.resolve_sync_loads(device, groups) is sync


def test_sync_loads_bad_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match="sync_loads"):
        StrataConfig.from_extra_config({"sync_loads": "sometimes"})


@pytest.mark.parametrize(("value", "device", "seconds"), [
    ("auto", "cpu", 1.0), ("auto", "cuda", 0.1), ("auto", "xpu", 0.1),
    (0, "cpu", 0.0), (0.0, "cuda", 0.0), (2.5, "cpu", 2.5), ("0.25", "cuda", 0.25),
])
def test_host_room_wait_s(value: object, device: str, seconds: float) -> None:
    cfg = StrataConfig.from_extra_config({"host_room_wait_s": value})
    assert cfg.resolve_host_room_wait_s(device) == seconds


@pytest.mark.parametrize("value", [-1, "soon", None, True, float("inf"), float("nan")])
def test_host_room_wait_s_bad_value_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="host_room_wait_s"):
        StrataConfig.from_extra_config({"host_room_wait_s": value})


def test_io_threads_auto_is_one_per_usable_core_at_most_four(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstrata.config as config

    cfg = StrataConfig.from_extra_config({})
    assert cfg.io_threads == "auto"
    for cores, threads in ((1, 1), (2, 2), (3, 3), (4, 4), (64, 4)):
        monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert cfg.resolve_io_threads() == threads
    # An explicit count is taken as given, whatever the cores.
    assert StrataConfig.from_extra_config({"io_threads": "6"}).resolve_io_threads() == 6


def test_write_threads_auto_is_one_on_cpu_and_one_per_usable_core_at_most_four_off_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstrata.config as config

    cfg = StrataConfig.from_extra_config({})
    assert cfg.write_threads == "auto"
    for cores, threads in ((1, 1), (2, 2), (3, 3), (4, 4), (64, 4)):
        monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert cfg.resolve_write_threads("cuda") == cfg.resolve_write_threads("xpu") == threads
        assert cfg.resolve_write_threads("cpu") == 1  # the forward keeps every core busy
    explicit = StrataConfig.from_extra_config({"write_threads": "3"})
    assert explicit.resolve_write_threads("cpu") == explicit.resolve_write_threads("cuda") == 3
    for bad in (0, 65, "many", 2.5):
        with pytest.raises(ConfigError, match="write_threads"):
            StrataConfig.from_extra_config({"write_threads": bad})


@pytest.mark.parametrize(("option", "threads_option"), [("read_processes", "io_threads"),
                                                       ("write_processes", "write_threads")])
def test_disk_processes_auto_are_none_on_cpu_and_one_per_thread_off_it(
        option: str, threads_option: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_processes`` / ``write_processes`` "auto": none on a CPU engine, one per read /
    write thread on an accelerator's."""
    import kvstrata.config as config

    def resolved(cfg: StrataConfig, device: str) -> int:
        return getattr(cfg, f"resolve_{option}")(device)

    cfg = StrataConfig.from_extra_config({})
    assert getattr(cfg, option) == "auto"
    for cores, processes in ((1, 1), (2, 2), (64, 4)):
        monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert resolved(cfg, "cuda") == resolved(cfg, "xpu") == processes
        assert resolved(cfg, "cpu") == 0
    threads = StrataConfig.from_extra_config({threads_option: 3})
    assert resolved(threads, "cuda") == 3 and resolved(threads, "cpu") == 0
    explicit = StrataConfig.from_extra_config({option: "2"})
    assert resolved(explicit, "cpu") == resolved(explicit, "cuda") == 2
    assert resolved(StrataConfig.from_extra_config({option: 0}), "cuda") == 0
    for bad in (-1, 65, "many", 1.5):
        with pytest.raises(ConfigError, match=option):
            StrataConfig.from_extra_config({option: bad})


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


SIZE_KEYS = ("host_bytes", "disk_bytes", "max_disk_write_backlog_bytes", "warm_start_bytes")


@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize(
    "value",
    ["1" * 400, "1" * 5000 + "GiB", 10**400, 1e300, "9" * 30 + "TiB", -1, "-1", "-1GiB", "1.5",
     "0.1KiB", 1.5, "nan", "NaN", "Infinity", "-inf", float("nan"), float("inf"), True, False,
     "²", "٤GiB", "4 GiBs", None, [4096]],
)
def test_bad_sizes_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'") as err:
        StrataConfig.from_extra_config({key: value})
    assert len(str(err.value)) < 200  # a 5000-digit value is not echoed whole


def test_sizes_are_exact_and_capped_at_one_exbibyte() -> None:
    assert parse_size("host_bytes", "0.5KiB") == 512
    assert parse_size("host_bytes", "9007199254740993") == 9007199254740993  # no float rounding
    assert parse_size("host_bytes", 4096.0) == 4096
    assert parse_size("disk_bytes", "1024TiB") == 1024 << 40
    assert parse_size("disk_bytes", 1 << 60) == 1 << 60
    with pytest.raises(ConfigError, match="'disk_bytes': must be at most"):
        parse_size("disk_bytes", (1 << 60) + 1)


@pytest.mark.parametrize(
    ("key", "value"),
    [("io_threads", "²"), ("io_threads", "٤"), ("io_threads", "1" * 400), ("io_threads", "1" * 5000),
     ("io_threads", 10**400), ("io_threads", "4.0"), ("io_threads", float("nan")),
     ("blocks_per_chunk", "²"), ("blocks_per_chunk", "1" * 5000), ("zstd_level", "³"),
     ("zstd_level", "-" + "1" * 5000), ("prefetch_concurrency", "٨"), ("admission", "²"),
     ("admission", "1" * 5000), ("admission", True)],
)
def test_bad_integers_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'") as err:
        StrataConfig.from_extra_config({key: value})
    assert len(str(err.value)) < 200


def test_integers_take_ascii_digit_strings() -> None:
    cfg = StrataConfig.from_extra_config(
        {"io_threads": " 8 ", "zstd_level": "+3", "admission": "2", "prefetch_concurrency": 16}
    )
    assert (cfg.io_threads, cfg.zstd_level, cfg.admission, cfg.prefetch_concurrency) == (8, 3, 2, 16)


@pytest.mark.parametrize("key", ["store_path", "host_shm_dir"])
@pytest.mark.parametrize("value", ["~kvstrata-no-such-user-7f3a/x", "/tmp/a\x00b", Path("/tmp/a\x00b"), b"/tmp/x"])
def test_bad_paths_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        StrataConfig.from_extra_config({key: value})


def test_bad_store_env_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA_STORE", "~kvstrata-no-such-user-7f3a/x")
    with pytest.raises(ConfigError, match=r"\$KVSTRATA_STORE: cannot expand"):
        StrataConfig.from_extra_config({})
    # An explicit store_path does not need the environment's default.
    assert StrataConfig.from_extra_config({"store_path": "/tmp/s"}).store_path == Path("/tmp/s")


@pytest.mark.parametrize("extra", [["host_bytes"], [("host_bytes", 1 << 20)], "host_bytes", "", [], 3])
def test_extra_config_must_be_a_mapping(extra: object) -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config must be a mapping"):
        StrataConfig.from_extra_config(extra)  # type: ignore[arg-type]


def test_non_string_keys_are_unknown_options() -> None:
    with pytest.raises(ConfigError, match=r"unknown kvstrata option\(s\) \[1, 'x'\]"):
        StrataConfig.from_extra_config({1: 2, "x": 3})


@pytest.mark.parametrize("key", ["max_age_s", "python_switch_interval_s"])
@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf"), -1, 0, -0.5, "nan", "NaN", "Infinity", "inf", "-1",
     "-1.5", "0", "1e400", 10**400, "1" * 5000, True, "²", "10s", [1]],
)
def test_bad_seconds_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"'{key}': expected a positive finite number of seconds") as err:
        StrataConfig.from_extra_config({key: value})
    assert len(str(err.value)) < 200


def test_seconds_take_numbers_and_decimal_strings() -> None:
    cfg = StrataConfig.from_extra_config({"max_age_s": "3600", "python_switch_interval_s": "5e-4"})
    assert cfg.max_age_s == 3600.0 and cfg.python_switch_interval_s == 0.0005
    cfg = StrataConfig.from_extra_config({"max_age_s": 0.25, "python_switch_interval_s": 1})
    assert cfg.max_age_s == 0.25 and cfg.python_switch_interval_s == 1.0


def test_background_priority_is_auto_unless_asked() -> None:
    assert StrataConfig.from_extra_config({}).background_priority == "auto"
    assert StrataConfig.from_extra_config({"background_priority": "idle"}).background_priority == "idle"
    assert StrataConfig.from_extra_config({"background_priority": "normal"}).background_priority == "normal"
    with pytest.raises(ConfigError, match="background_priority"):
        StrataConfig.from_extra_config({"background_priority": "low"})


@pytest.mark.parametrize(("value", "device", "resolved"), [
    ("auto", "cpu", "auto"), ("auto", "cuda", "normal"), ("auto", "xpu", "normal"),
    ("idle", "cuda", "idle"), ("normal", "cpu", "normal"), ("idle", "cpu", "idle"),
])
def test_auto_background_priority_is_normal_off_cpu(value: str, device: str, resolved: str) -> None:
    cfg = StrataConfig.from_extra_config({"background_priority": value})
    assert cfg.resolve_background_priority(device) == resolved


def test_disk_reserve_is_a_size_or_a_share_of_the_file_system(tmp_path: Path) -> None:
    assert StrataConfig.from_extra_config({}).disk_reserve == 1 << 30
    assert StrataConfig.from_extra_config({"disk_reserve": "2GiB"}).resolve_disk_reserve(tmp_path) == 2 << 30
    assert StrataConfig.from_extra_config({"disk_reserve": 0}).resolve_disk_reserve(tmp_path) == 0
    # A share is of the file system the store will be on (it need not exist yet).
    import os

    st = os.statvfs(tmp_path)
    share = StrataConfig.from_extra_config({"disk_reserve": " 2.5 % "})
    assert share.disk_reserve == "2.5 %"
    assert share.resolve_disk_reserve(tmp_path / "not" / "yet") == st.f_blocks * st.f_frsize * 25 // 1000


@pytest.mark.parametrize("value", ["51%", "-5%", "5%%", "%", "five%", "1e2%", "5%GiB", "lots", -1, True])
def test_bad_disk_reserves_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="'disk_reserve'"):
        StrataConfig.from_extra_config({"disk_reserve": value})
