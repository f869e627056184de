"""ReuseMeter: whether a lower tier's writes are read back (the write-behind's catch-up gate)."""

from __future__ import annotations

import pytest

from kvstrata.tiers.hierarchy.reuse import MIN_REUSE, WARM_UP_BYTES, ReuseMeter

MB = 1 << 20


def test_a_fresh_tier_is_assumed_read_back_until_its_warm_up_is_over() -> None:
    m = ReuseMeter(10 * MB)
    assert m.ratio == 0.0 and m.paying()  # nothing could have come back yet
    for _ in range(4):
        m.admitted(2 * MB)
    assert m.paying()  # 8 MB of the 10 MB warm-up
    m.admitted(2 * MB)
    assert not m.paying()  # past it, with nothing read back


def test_the_warm_up_is_bounded_however_large_the_host_tier() -> None:
    m = ReuseMeter(64 << 30)  # a 32 GiB host tier: evidence fades over 64 GiB written
    m.admitted(WARM_UP_BYTES - 1)
    assert m.paying()
    m.admitted(1)
    assert not m.paying()  # a workload without reuse pays at most WARM_UP_BYTES per process


def test_a_workload_without_reuse_never_pays() -> None:
    m = ReuseMeter(100 * MB)
    for _ in range(1000):
        m.admitted(2 * MB)
    m.read_back(2 * MB)  # one duplicate prompt among a thousand chunks
    assert m.ratio < MIN_REUSE and not m.paying()


@pytest.mark.parametrize(("back", "pays"), [(0.12, True), (0.08, False)])
def test_catching_up_pays_from_a_tenth_read_back(back: float, pays: bool) -> None:
    m = ReuseMeter(10 * MB)
    for _ in range(100):  # well past the warm-up
        m.admitted(2 * MB)
        m.read_back(int(back * 2 * MB))
    assert m.ratio == pytest.approx(back, rel=1e-3)
    assert m.paying() is pays


def test_reuse_fades_once_the_workload_stops_coming_back() -> None:
    m = ReuseMeter(10 * MB)
    for _ in range(10):
        m.admitted(2 * MB)
        m.read_back(2 * MB)
    assert m.paying()
    for _ in range(40):  # 80 MB admitted, nothing read back: 8 half-lives
        m.admitted(2 * MB)
    assert not m.paying()
    m.read_back(4 * MB)  # and it comes back within a request or two when reuse returns
    assert m.paying()


def test_a_restarted_store_that_serves_counts_as_read_back() -> None:
    m = ReuseMeter(100 * MB)
    m.read_back(2 * MB)
    assert m.ratio == 1.0 and m.paying()


def test_lost_chunks_asked_for_count_once_and_the_ghost_list_is_bounded() -> None:
    m = ReuseMeter(1 << 40, ghost_capacity=2)
    for i in range(3):
        m.admitted(MB)
        m.lost(bytes([i]), MB)
    m.asked_for([b"\x00"])  # pushed out of the ghost list by the two later losses
    assert m.ratio == 0.0
    m.asked_for([b"\x01", b"\x02", b"\x09"])
    assert m.ratio == pytest.approx(2 / 3, rel=1e-3)
    m.asked_for([b"\x01", b"\x02"])  # asked again: already counted
    assert m.ratio == pytest.approx(2 / 3, rel=1e-3)


def test_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="half_life_bytes"):
        ReuseMeter(0)
