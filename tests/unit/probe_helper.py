"""A recording probe for the pure semantics: answers each key from a table (MISS when absent) and
keeps every key asked, in order."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.presence import Presence


class Probe:
    def __init__(self, answers: dict[bytes, Presence]):
        self.answers = answers
        self.asked: list[bytes] = []

    def __call__(self, keys: Sequence[bytes]) -> list[Presence]:
        self.asked.extend(keys)
        return [self.answers.get(k, Presence.MISS) for k in keys]
