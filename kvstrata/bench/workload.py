"""The seeded multi-round long-context workload of ``kvstrata bench serve`` (issue 31).

U users share one system prompt; each has its own long context of real text (a slice of Python's
standard library source, ``tools.corpus``) of 1.5-3k tokens after it. Each user asks R rounds: a
round's prompt is the previous round's prompt, its answer and a new question, so every round after
the first reuses the whole previous conversation. Users arrive as a Poisson process; after an
answer a user waits an exponential think time before the next round. Everything (contexts,
questions, arrival and think times) derives from the seed: every configuration replays the same
requests at the same offsets.

Prompts are token ids (``/v1/completions`` takes them as a list): the model's ``tokenizer.json``
encodes the text when it has one; a tiny random checkpoint without a tokenizer gets ids drawn from
its vocabulary by the same seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUESTIONS = (
    "Summarise what the code above does in two sentences.",
    "Which function above would you test first, and why?",
    "Name one edge case the code above handles.",
    "What would you rename in the code above to make it clearer?",
    "Which part of the code above is the most expensive to run?",
    "Explain the main data structure used above.",
)


class WorkloadError(ValueError):
    """Workload parameters that cannot produce the asked workload."""


@dataclass(frozen=True)
class WorkloadSpec:
    users: int = 6
    rounds: int = 3
    system_tokens: int = 256
    context_min: int = 1500
    context_max: int = 3000
    question_tokens: int = 24  # ids-only models: length of a synthetic question
    max_tokens: int = 32
    arrival_rate: float = 0.5  # users per second (Poisson)
    think_s: float = 1.0  # mean think time between a user's rounds
    seed: int = 0

    def check(self, max_model_len: int) -> None:
        if self.users < 1 or self.rounds < 1:
            raise WorkloadError(f"users and rounds must be >= 1 (got {self.users}, {self.rounds})")
        if not 0 < self.context_min <= self.context_max:
            raise WorkloadError(f"context tokens must satisfy 0 < min <= max "
                                f"(got {self.context_min}..{self.context_max})")
        if self.arrival_rate <= 0 or self.think_s < 0 or self.max_tokens < 1:
            raise WorkloadError("arrival rate must be > 0, think time >= 0, max tokens >= 1")
        longest = (self.system_tokens + self.context_max
                   + self.rounds * (self.max_tokens + self.question_tokens + 64))
        if longest > max_model_len:
            raise WorkloadError(f"the last round can reach {longest} tokens, over the servers' "
                                f"max model length {max_model_len}: lower --context-max, "
                                "--rounds or --max-tokens")


@dataclass
class UserScript:
    """One user's fixed parts: arrival offset, first prompt, later questions and think times."""

    user: int
    arrival_s: float
    first_prompt: list[int]
    questions: list[list[int]]  # rounds 2..R
    think_s: list[float]  # before rounds 2..R
    context_tokens: int = 0


@dataclass
class Workload:
    spec: WorkloadSpec
    users: list[UserScript] = field(default_factory=list)

    def total_context_tokens(self) -> int:
        return sum(len(u.first_prompt) for u in self.users)


class Encoder:
    """Text -> token ids with the model's tokenizer, or seeded synthetic ids without one."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        self.tokenizer: Any = None
        self.vocab = 1024
        tok = model_dir / "tokenizer.json"
        if tok.is_file():
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(tok))
        else:
            cfg = model_dir / "config.json"
            if cfg.is_file():
                self.vocab = int(json.loads(cfg.read_text()).get("vocab_size", self.vocab))
        self.rng = random.Random(seed ^ 0x5EED)

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def encode(self, text: str, n: int | None = None) -> list[int]:
        if self.tokenizer is None:
            length = n if n is not None else max(1, len(text.split()))
            # Ids 3.. skip the tiny checkpoints' special ids (bos 1, eos 2).
            return [self.rng.randrange(3, self.vocab) for _ in range(length)]
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return ids[:n] if n is not None else ids


def build_workload(model_dir: Path, spec: WorkloadSpec) -> Workload:
    """The seeded workload for ``model_dir`` (its tokenizer decides the ids)."""
    from kvstrata.tools.corpus import stdlib_text

    rng = random.Random(spec.seed)
    enc = Encoder(model_dir, spec.seed)
    text = stdlib_text(min_chars=400_000)
    lines = text.splitlines()
    system = enc.encode("You are a careful code reviewer. Answer briefly and precisely.\n"
                        + "\n".join(lines[:400]), spec.system_tokens)
    wl = Workload(spec)
    t = 0.0
    for u in range(spec.users):
        t += rng.expovariate(spec.arrival_rate) if u else 0.0
        n_ctx = rng.randint(spec.context_min, spec.context_max)
        start = rng.randrange(400, max(401, len(lines) - 2000))
        context = enc.encode(f"\n# user {u}\n" + "\n".join(lines[start:start + 1500]), n_ctx)
        if len(context) < n_ctx:  # short slice: wrap around the text
            context += enc.encode("\n".join(lines[:3000]), n_ctx - len(context))
        q = [enc.encode("\nQuestion: " + QUESTIONS[(u + r) % len(QUESTIONS)] + "\nAnswer:",
                        spec.question_tokens) for r in range(spec.rounds)]
        wl.users.append(UserScript(
            user=u, arrival_s=t, first_prompt=system + context + q[0], questions=q[1:],
            think_s=[rng.expovariate(1.0 / spec.think_s) if spec.think_s > 0 else 0.0
                     for _ in range(spec.rounds - 1)],
            context_tokens=len(context)))
    return wl


def long_prompt(model_dir: Path, tokens: int, seed: int) -> list[int]:
    """One prompt of exactly ``tokens`` ids of real text (the long-context sweep)."""
    from kvstrata.tools.corpus import stdlib_text

    enc = Encoder(model_dir, seed)
    text = stdlib_text(min_chars=max(200_000, tokens * 6))
    lines = text.splitlines()
    shift = random.Random(seed).randrange(0, max(1, len(lines) // 2))
    ids = enc.encode("\n".join(lines[shift:] + lines[:shift]), tokens)
    if len(ids) < tokens:
        raise WorkloadError(f"the corpus holds only {len(ids)} tokens, {tokens} asked")
    return ids
