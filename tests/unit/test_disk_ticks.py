"""A store's buffered access ticks (``tiers/disk/ticks.py``): what the writer takes to write, and
the changes a copy kept elsewhere (the put process's) follows."""

from __future__ import annotations

from kvstrata.tiers.disk.ticks import FLUSH_AT, AccessTicks


def test_a_copy_follows_the_ticks_by_their_changes() -> None:
    ticks = AccessTicks(lambda: None)
    ticks.touch([b"a", b"b"], 1)
    epoch, first = ticks.changes(full=False)  # nothing sent before: everything
    assert first == {b"a": 1, b"b": 1}
    ticks.touch([b"b"], 5)
    ticks.touch([b"c"], 6)
    assert ticks.changes(full=False) == (epoch, {b"b": 5, b"c": 6})
    assert ticks.changes(full=False) == (epoch, {})
    assert ticks.changes(full=True) == (epoch, {b"a": 1, b"b": 5, b"c": 6})  # a new copy
    ticks.forget([b"c"])
    ticks.touch([b"d"], 7)
    ticks.forget([b"d"])
    assert ticks.changes(full=False) == (epoch, {})
    assert ticks.snapshot() == {b"a": 1, b"b": 5}


def test_taking_the_ticks_starts_a_new_epoch() -> None:
    ticks = AccessTicks(lambda: None)
    ticks.touch([b"a"], 1)
    epoch, _ = ticks.changes(full=False)
    ticks.touch([b"b"], 2)
    assert ticks.take() == {b"a": 1, b"b": 2}  # written by the caller: the copy drops them
    ticks.touch([b"c"], 3)
    new_epoch, changed = ticks.changes(full=False)
    assert new_epoch != epoch and changed == {b"c": 3}
    assert ticks.snapshot() == {b"c": 3}


def test_many_ticks_ask_for_a_flush() -> None:
    asked: list[int] = []
    ticks = AccessTicks(lambda: asked.append(1))
    ticks.touch([i.to_bytes(4, "big") for i in range(FLUSH_AT - 1)], 1)
    assert asked == []
    ticks.touch([b"last"], 2)
    assert asked == [1]
