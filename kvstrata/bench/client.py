"""Concurrent streaming clients replaying a :class:`~kvstrata.bench.workload.Workload` over HTTP.

asyncio + aiohttp (vLLM's own dependency, so always in its environment). Each user is one task:
it waits for its arrival offset, streams its round, appends the answer's token ids
(``return_token_ids``) and the next question, thinks, and goes on. With several servers the users
are spread round-robin over them by request (the two-replica configurations), so a user's next
round usually lands on the other replica: its reuse must come from a tier both share.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstrata.bench.workload import Workload

REQUEST_TIMEOUT_S = 900.0


@dataclass
class RequestResult:
    user: int
    round: int
    server: int
    prompt_tokens: int
    prompt_digest: str = ""  # same digest: the same prompt token ids
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    start_s: float = 0.0  # since the run started
    end_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    # First token's top-k logprobs {token id: logprob} (when asked).
    top_logprobs: dict[int, float] | None = None
    # The longest prefix of this prompt that an earlier request had already sent (its prompt,
    # or its prompt and answer once it finished): what a cache of unbounded size could serve.
    reusable_tokens: int = 0
    # Prompt tokens the server did not compute (its usage's ``cached_tokens``: vLLM's prefix
    # cache and a connector's hits); None when it did not say.
    cached_tokens: int | None = None


def digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SeenPrefixes:
    """Every token sequence the workload sent so far, to measure each new prompt's reusable
    prefix (``RequestResult.reusable_tokens``): a request's prompt counts from the moment it
    is sent (its prefill is under way), its answer once it finished."""

    def __init__(self) -> None:
        self._seqs: list[list[int]] = []

    def add(self, tokens: list[int]) -> int:
        """Record ``tokens`` (sent now); returns its index for :meth:`extend`."""
        self._seqs.append(tokens)
        return len(self._seqs) - 1

    def extend(self, index: int, tokens: list[int]) -> None:
        """The sequence at ``index`` grew (a finished request's answer)."""
        self._seqs[index] = tokens

    def reusable(self, prompt: Sequence[int]) -> int:
        return max((common_prefix(prompt, s) for s in self._seqs), default=0)


class _RoundRobin:
    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0

    def next(self) -> int:
        self.i = (self.i + 1) % self.n
        return self.i


def _top_ids(top: dict[str, float]) -> dict[int, float]:
    # return_tokens_as_token_ids: keys are "token_id:N" (no detokenizer needed).
    out: dict[int, float] = {}
    for key, value in top.items():
        if key.startswith("token_id:"):
            out[int(key.split(":", 1)[1])] = float(value)
    return out


async def stream_completion(session: Any, base: str, model: str, prompt: list[int],
                            max_tokens: int, result: RequestResult, t0: float,
                            logprobs: int | None = None) -> None:
    """One streamed ``/v1/completions`` request; fills ``result`` (never raises)."""
    import aiohttp

    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
        body["return_tokens_as_token_ids"] = True
    start = time.perf_counter()
    result.start_s = start - t0
    last = start
    try:
        async with session.post(f"{base}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return
                cached = ((chunk.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                if isinstance(cached, int):
                    result.cached_tokens = cached
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                        lp = choice.get("logprobs") or {}
                        tops = lp.get("top_logprobs") or []
                        if tops and tops[0]:
                            result.top_logprobs = _top_ids(tops[0])
                    else:
                        # Several tokens in one chunk share its arrival: spread evenly.
                        result.itl_s += [(now - last) / len(ids)] * len(ids)
                    last = now
                    result.output_ids += [int(i) for i in ids]
        result.output_tokens = len(result.output_ids)
        result.ok = result.ttft_s is not None
        if not result.ok:
            result.error = "no token streamed"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.end_s = time.perf_counter() - t0


async def _user(session: Any, bases: Sequence[str], model: str, wl: Workload, u: int,
                rr: _RoundRobin, t0: float, results: list[RequestResult],
                done: Callable[[RequestResult], None], logprobs: int | None,
                seen: SeenPrefixes) -> None:
    script = wl.users[u]
    await asyncio.sleep(max(0.0, script.arrival_s - (time.perf_counter() - t0)))
    prompt = list(script.first_prompt)
    for r in range(wl.spec.rounds):
        server = rr.next()
        res = RequestResult(user=u, round=r, server=server, prompt_tokens=len(prompt),
                            prompt_digest=digest(prompt), reusable_tokens=seen.reusable(prompt))
        sent = seen.add(prompt)
        await stream_completion(session, bases[server], model, prompt, wl.spec.max_tokens, res,
                                t0, logprobs)
        seen.extend(sent, prompt + res.output_ids)
        results.append(res)
        done(res)
        if r + 1 == wl.spec.rounds:
            break
        # A failed round still goes on with the user's next question (its answer is empty).
        prompt = prompt + res.output_ids + script.questions[r]
        await asyncio.sleep(script.think_s[r])


async def _run(bases: Sequence[str], model: str, wl: Workload,
               done: Callable[[RequestResult], None], logprobs: int | None,
               ) -> tuple[list[RequestResult], float]:
    import aiohttp

    results: list[RequestResult] = []
    rr = _RoundRobin(len(bases))
    seen = SeenPrefixes()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(_user(session, bases, model, wl, u, rr, t0, results, done,
                                     logprobs, seen) for u in range(len(wl.users))))
        return results, time.perf_counter() - t0


def run_workload(bases: Sequence[str], model: str, wl: Workload,
                 done: Callable[[RequestResult], None] | None = None,
                 logprobs: int | None = None) -> tuple[list[RequestResult], float]:
    """Replay ``wl`` against ``bases`` (round-robin by request); (results, wall seconds)."""
    return asyncio.run(_run(bases, model, wl, done or (lambda r: None), logprobs))


def one_request(base: str, model: str, prompt: list[int], max_tokens: int,
                logprobs: int | None = None) -> RequestResult:
    """A single streamed request (the long-context sweep)."""
    import aiohttp

    async def go() -> RequestResult:
        res = RequestResult(user=0, round=0, server=0, prompt_tokens=len(prompt))
        async with aiohttp.ClientSession() as session:
            await stream_completion(session, base, model, prompt, max_tokens, res,
                                    time.perf_counter(), logprobs)
        return res

    return asyncio.run(go())
