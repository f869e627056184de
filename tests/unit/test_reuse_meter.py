"""ReuseMeter: whether a lower tier's writes are read back (the ``write_reuse`` gauge)."""

from __future__ import annotations

import pytest

from kvstrata.tiers.hierarchy.reuse import ReuseMeter

MB = 1 << 20


def test_a_fresh_tier_has_read_nothing_back() -> None:
    m = ReuseMeter(10 * MB)
    assert m.ratio == 0.0
    m.admitted(2 * MB)
    assert m.ratio == 0.0


def test_a_workload_without_reuse_reads_back_almost_nothing() -> None:
    m = ReuseMeter(100 * MB)
    for _ in range(1000):
        m.admitted(2 * MB)
    m.read_back(2 * MB)  # one duplicate prompt among a thousand chunks
    assert 0 < m.ratio < 0.05


@pytest.mark.parametrize("back", [0.12, 0.5, 1.0])
def test_the_ratio_is_the_share_read_back(back: float) -> None:
    m = ReuseMeter(10 * MB)
    for _ in range(100):
        m.admitted(2 * MB)
        m.read_back(int(back * 2 * MB))
    assert m.ratio == pytest.approx(back, rel=1e-3)


def test_reuse_fades_once_the_workload_stops_coming_back() -> None:
    m = ReuseMeter(10 * MB)
    for _ in range(10):
        m.admitted(2 * MB)
        m.read_back(2 * MB)
    assert m.ratio == pytest.approx(1.0, rel=1e-3)
    for _ in range(40):  # 80 MB admitted, nothing read back: 8 half-lives
        m.admitted(2 * MB)
    assert m.ratio < 0.01
    m.read_back(4 * MB)  # and it shows within a request or two when reuse returns
    assert m.ratio > 0.1


def test_a_restarted_store_that_serves_counts_as_read_back() -> None:
    m = ReuseMeter(100 * MB)
    m.read_back(2 * MB)
    assert m.ratio == 1.0


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
