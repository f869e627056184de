"""Equivalence to recomputation: a request served from kvstrata must produce what recomputing its
prompt produces.

A kvstrata engine's outputs are compared with those of the same engine without kvstrata that
computes each prompt on its own (a cache salt per prompt: it reuses nothing): the first generated
token's top log-probabilities within ``TOLERANCE`` with the same argmax, and the same greedy
tokens after it. Token counts and stored bytes cannot see a request that attends a wrong or a
null block; this can.

Prompts (``prompt_rounds``) come from a seeded RNG, with lengths at every boundary the layout has
(``boundary_lengths``): block and chunk multiples +-2, sliding-window boundaries (``N - W + 1`` on
a block), Mamba chunks, the hash unit of partial tails, and 1- and 2-token prompts. Half share one
trunk (prefixes and extensions of one another), half are independent; the second round repeats
them exactly and adds extensions and truncations of the independent ones. After a restart come
multi-turn follow-ups (``follow_ups``): a prompt, the model's own answer to it, a new turn.
``KVSTRATA_EQUIVALENCE_SEEDS`` (default 1) runs that many seeds' prompts through the same engines
(a longer soak).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# |logprob(served) - logprob(recomputed)| allowed for the first token's top tokens (float32).
TOLERANCE = 1e-4
TOP_K = 5
EQ_MAX_TOKENS = 4
PROMPT_LIMIT = 1536  # tokens: leaves room for follow-ups within the engines' max_model_len
# One line per round checked in this session ("case round: cases N served-by-kvstrata S ..."),
# printed at the end of the run (tests/e2e/conftest.py).
COUNTS: list[str] = []


def seeds() -> list[int]:
    """The prompt seeds of this run: ``KVSTRATA_EQUIVALENCE_SEEDS`` of them (default 1)."""
    raw = os.environ.get("KVSTRATA_EQUIVALENCE_SEEDS", "1")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"KVSTRATA_EQUIVALENCE_SEEDS must be a positive integer, not {raw!r}") from None
    if n < 1:
        raise ValueError(f"KVSTRATA_EQUIVALENCE_SEEDS must be a positive integer, not {raw!r}")
    return list(range(1, n + 1))


@dataclass(frozen=True)
class Boundaries:
    """The token counts where a layout's behaviour changes."""

    block: int
    chunk: int
    window: int | None = None  # sliding window (tokens)
    mamba_chunk: int | None = None  # align-mode Mamba chunk (tokens)
    hash_unit: int | None = None  # prefix_match_unit finer than the blocks (partial tails)


def boundary_lengths(b: Boundaries, limit: int = PROMPT_LIMIT) -> list[int]:
    lengths = {1, 2}
    for unit in {b.block, b.chunk, b.mamba_chunk or b.block}:
        lengths.update(k * unit + d for k in (1, 2) for d in range(-2, 3))
    if b.window:
        # N - W + 1 on a block boundary: the recomputed last token attends position N - W, the
        # last position of the block below (issue 22, defect 1), and its neighbours.
        lengths.update(k * b.block + b.window - 1 + d for k in (1, 2) for d in (-1, 0, 1))
    if b.hash_unit:
        lengths.update(k * b.hash_unit + d for k in range(1, 8) for d in (0, 1, 2))
    return sorted(n for n in lengths if 1 <= n <= limit)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab - 8) for _ in range(n)]


@dataclass
class Rounds:
    """The equivalence prompts of a case: ``first`` (cold), ``second`` (served), and which of
    them share nothing with any other prompt (``independent``)."""

    first: list[list[int]]
    second: list[list[int]]
    independent: set[tuple[int, ...]]


def prompt_rounds(b: Boundaries, vocab: int, seed_list: Iterable[int]) -> Rounds:
    first: list[list[int]] = []
    second: list[list[int]] = []
    independent: set[tuple[int, ...]] = set()
    for seed in seed_list:
        rng = random.Random(seed)
        lengths = boundary_lengths(b) + [rng.randint(3, PROMPT_LIMIT // 2) for _ in range(3)]
        trunk = _tokens(rng, max(lengths) + 8, vocab)
        base = [trunk[:n] if i % 2 else _tokens(rng, n, vocab) for i, n in enumerate(lengths)]
        first += base
        second += base  # exact repeats
        for i, p in enumerate(base):
            if i % 2:
                continue  # the trunk's prefixes extend and truncate one another already
            independent.add(tuple(p))
            if len(p) > 3:
                second.append(p + _tokens(rng, 1 + i % 3, vocab))
                second.append(p[: len(p) - 1 - i % 3])
            if i % 6 == 0:
                second.append(p + _tokens(rng, b.block + 1, vocab))  # a block and a token more
    return Rounds(_unique(first), _unique(second), independent)


def follow_ups(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], vocab: int,
               seed: int = 0) -> list[tuple[list[int], int]]:
    """Multi-turn follow-ups, with the length of their first turn: every third prompt, the
    model's answer (without its last token, whose KV is never written) and a new turn."""
    rng = random.Random(seed)
    out: dict[tuple[int, ...], int] = {}
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        if i % 3 == 0:
            out.setdefault((*p, *a[:-1], *_tokens(rng, 2 + i % 5, vocab)), len(p))
    return [(list(k), n) for k, n in out.items()]


def _unique(prompts: Iterable[list[int]]) -> list[list[int]]:
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        if tuple(p) not in seen:
            seen.add(tuple(p))
            out.append(p)
    return out


def reference_step(name: str, prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
    """Each prompt computed on its own: a salt of its own keeps every cache out of it."""
    return {"op": "generate", "name": name, "prompts": [list(p) for p in prompts],
            "max_tokens": max_tokens, "logprobs": TOP_K,
            "cache_salt": [f"{name}-{i}" for i in range(len(prompts))]}


def served_tokens(out: dict[str, Any]) -> int:
    """Prompt tokens kvstrata served one completion (a ``Completion`` dict), every tier together.
    vLLM's ``num_cached_tokens`` is not that: it adds vLLM's own prefix-cache hits."""
    return sum(out["served"].values())


@dataclass
class Verdict:
    prompt_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens at scheduling: its own prefix cache, kvstrata's hits, and loads claimed that later failed
    served_by_tier: dict[str, int]  # what kvstrata served, by the tier it came from
    max_delta: float
    problem: str | None  # None: equal to the recomputation

    @property
    def served_tokens(self) -> int:
        return sum(self.served_by_tier.values())

    @property
    def served(self) -> bool:
        """kvstrata served this request some of its prompt (vLLM's own cache does not count)."""
        return self.served_tokens > 0


def compare(reference: dict[str, Any], got: dict[str, Any]) -> Verdict:
    """One served completion against its recomputation (both ``Completion`` dicts)."""
    ref_lp = {int(t): lp for t, lp in reference["first_logprobs"]}
    got_lp = {int(t): lp for t, lp in got["first_logprobs"]}
    ranked = [int(t) for t, _ in reference["first_logprobs"]]
    problem = None
    deltas = [abs(got_lp[t] - ref_lp[t]) for t in ranked if t in got_lp]
    max_delta = max(deltas, default=float("inf"))
    if got["token_ids"][:1] != ranked[:1]:
        problem = f"argmax {got['token_ids'][:1]} != {ranked[:1]}"
    elif any(t not in got_lp for t in ranked[:-1]):  # the last rank may swap with a near tie
        problem = f"top tokens {sorted(got_lp)} != {sorted(ref_lp)}"
    elif max_delta > TOLERANCE:
        problem = f"first-token logprobs differ by {max_delta:.3g}"
    elif got["token_ids"] != reference["token_ids"]:
        problem = f"greedy tokens {got['token_ids']} != {reference['token_ids']}"
    return Verdict(got["prompt_tokens"], got["num_cached_tokens"], dict(got["served"]), max_delta, problem)


def compare_step(references: dict[tuple[int, ...], dict[str, Any]], step: dict[str, Any],
                 prompts: Sequence[Sequence[int]]) -> list[Verdict]:
    """Every completion of a generate step against the recomputation of its prompt."""
    outputs = step["outputs"]
    assert len(outputs) == len(prompts), (len(outputs), len(prompts))
    return [compare(references[tuple(p)], out) for p, out in zip(prompts, outputs, strict=True)]


def references_of(steps: Iterable[tuple[Sequence[Sequence[int]], dict[str, Any]]]) -> dict[tuple[int, ...], dict[str, Any]]:
    """prompt -> its recomputed completion, from (prompts, reference step) pairs."""
    out: dict[tuple[int, ...], dict[str, Any]] = {}
    for prompts, step in steps:
        for p, o in zip(prompts, step["outputs"], strict=True):
            out[tuple(p)] = o
    return out


def summary(verdicts: Sequence[Verdict]) -> str:
    """Requests, those kvstrata served (and the tokens it served, by tier), those equal to the
    recomputation; vLLM's own prefix-cache hits apart."""
    served = [v for v in verdicts if v.served]
    diverged = [v for v in verdicts if v.problem]
    worst = max((v.max_delta for v in served if v.problem is None), default=0.0)
    tiers: dict[str, int] = {}
    for v in served:
        for tier, n in v.served_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + n
    by_tier = " ".join(f"{tier} {n}" for tier, n in sorted(tiers.items())) or "none"
    local = sum(v.cached_tokens - v.served_tokens for v in verdicts)
    return (f"cases {len(verdicts)} served-by-kvstrata {len(served)} identical "
            f"{len(verdicts) - len(diverged)} diverged {len(diverged)} (largest |dlogprob| served "
            f"{worst:.2g}; kvstrata tokens {sum(tiers.values())}: {by_tier}; other cached "
            f"tokens {local}: vLLM's own prefix cache, or loads that failed and were recomputed)")


def divergences(verdicts: Sequence[Verdict]) -> list[str]:
    return [f"{v.prompt_tokens} tokens, {v.cached_tokens} cached ({v.served_tokens} by kvstrata): {v.problem}"
            for v in verdicts if v.problem]
