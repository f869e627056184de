"""kvstrata's store plans against vLLM 0.32.0's own ``OffloadingConnectorScheduler``, over seeded
random store traces on random group layouts: step by step through prefill, decode (with
multi-token acceptance) and finish or abort, the chunks offered, the blocks copied and the
per-group scan positions must equal vLLM's (docs/SEMANTICS.md)."""

from __future__ import annotations

import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))

from semantics_differential_helpers import (  # noqa: E402
    any_random_layout,
)
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_offload_harness import (  # noqa: E402
    StoreScript,
    build_scheduler,
    make_request,
)

from kvstrata.semantics import (  # noqa: E402
    ChunkTransfer,
    GroupGeometry,
    GroupKind,
    Layout,
    cdiv,
    chunk_keys,
    offloadable_tokens,
    plan_store,
)

NUM_STORE_TRACES = 400


# --------------------------------------------------------------------------- store traces
@dataclass
class StoreTrace:
    layout: Layout
    family: str
    prompt: int
    total: int
    hashes: list[bytes]
    offload_prompt_only: bool
    max_offload: int | None
    shared_prefix_boundary: int | None
    abort_after_step: int | None


def random_store_trace(rng: random.Random, trace_id: int) -> StoreTrace:
    layout, family = any_random_layout(rng)
    max_tpc = max(g.tokens_per_chunk for g in layout.groups)
    prompt = rng.randint(1, 5 * max_tpc)
    total = prompt + rng.randint(1, 3 * max_tpc)  # a request samples at least one token
    return StoreTrace(
        layout=layout,
        family=family,
        prompt=prompt,
        total=total,
        hashes=[f"s{trace_id}:{i}".encode() for i in range((total + 4) // layout.tokens_per_hash)],
        offload_prompt_only=rng.random() < 0.3,
        max_offload=rng.randint(0, total) if rng.random() < 0.15 else None,
        shared_prefix_boundary=rng.randint(1, prompt) if rng.random() < 0.2 else None,
        abort_after_step=rng.randint(0, 6) if rng.random() < 0.15 else None,
    )


def _new_block_ids(
    g: GroupGeometry, have: int, computed: int, until: int, ids, rng: random.Random
) -> list[int]:
    """Block ids a step allocates for positions ``have..`` up to token ``until``: null where the
    group already skips the position (as vLLM's managers allocate)."""
    target = cdiv(until, g.tokens_per_block)
    tpb = g.tokens_per_block
    if g.kind is GroupKind.SLIDING:
        skipped = max(0, computed - g.sliding_window + 1 - g.extra_retained_tokens)
    elif g.kind is GroupKind.CHUNKED_LOCAL:
        skipped = computed // g.attention_chunk_size * g.attention_chunk_size
    elif g.kind is GroupKind.MAMBA:
        skipped = max(0, (target - 1) * tpb)  # align mode keeps only the newest state block
    else:
        skipped = 0
    return [0 if (p + 1) * tpb <= skipped else next(ids) for p in range(have, target)]


def _zero_stale_leading_blocks(
    g: GroupGeometry, blocks: list[int], next_stored: int, rng: random.Random
) -> None:
    """A freed sliding-window block re-allocated to someone else is zeroed (``_update_req_states``).

    Only leading blocks of a chunk are zeroed here: kvstrata refuses chunks with a null block after
    a real one, where vLLM would copy the remaining blocks to the wrong offsets.
    """
    bpc = g.blocks_per_chunk
    complete = len(blocks) // bpc
    if complete <= next_stored or rng.random() > 0.3:
        return
    chunk = rng.randint(next_stored, complete - 1)
    for j in range(rng.randint(1, bpc)):
        blocks[chunk * bpc + j] = 0


def _answer(rng: random.Random, offered: list[bytes]):
    """What the store answers an offer: ``prepare_store`` outcomes incl. failure and partial."""
    r = rng.random()
    if r < 0.1:
        return "none"
    if r < 0.15:
        return "empty"
    if r < 0.3:
        return set(rng.sample(offered, k=rng.randint(0, len(offered))))
    return "all"


def _expected_src(layout: Layout, accepted: list[ChunkTransfer]):
    ids, sizes, indices = [], [], []
    for g in layout.groups:
        mine = [t for t in accepted if t.group == g.index]
        ids += [b for t in mine for b in t.block_ids]
        sizes.append(sum(len(t.block_ids) for t in mine))
        indices.append(
            mine[0].chunk_index * g.blocks_per_chunk + mine[0].first_block_in_chunk if mine else 0
        )
    return ids, sizes, indices


def run_store_trace(trace: StoreTrace, rng: random.Random) -> Counter[str]:
    layout = trace.layout
    script = StoreScript()
    speculative = trace.family == "spec_no_annotation" or any(g.is_drafter for g in layout.groups)
    sched = build_scheduler(
        layout, script, speculative=speculative, offload_prompt_only=trace.offload_prompt_only
    )
    params = {"max_offload_tokens": trace.max_offload} if trace.max_offload is not None else None
    request = make_request(
        "req",
        num_tokens=trace.prompt,
        num_prompt_tokens=trace.prompt,
        block_hashes=[],
        kv_transfer_params=params,
    )
    request.shared_prefix_boundary = trace.shared_prefix_boundary
    sched.on_new_request(request)
    vstate = sched._req_status["req"]
    tph = layout.tokens_per_hash
    ids = iter(range(1, 1 << 30))
    blocks = {g.index: [] for g in layout.groups}
    next_stored = {g.index: 0 for g in layout.groups}
    stats: Counter[str] = Counter()
    computed, num_tokens, step = 0, trace.prompt, 0

    def compare(scheduled: int, finished: bool, aborted: bool) -> None:
        request.block_hashes = trace.hashes[: num_tokens // tph]
        vstate.update_offload_keys()  # as _update_req_states / request_finished do (R38)
        keys = {g.index: chunk_keys(request.block_hashes, g) for g in layout.groups}
        offers_before = len(script.offers)
        offloadable = offloadable_tokens(
            num_computed=computed,
            num_scheduled=scheduled,
            num_tokens=num_tokens,
            num_prompt_tokens=trace.prompt,
            finished=finished,
            aborted=aborted,
            offload_prompt_only=trace.offload_prompt_only,
            max_offload_tokens=trace.max_offload,
        )
        candidates, advanced = plan_store(
            layout,
            offloadable=offloadable,
            num_prompt_tokens=trace.prompt,
            finished=finished,
            next_stored_chunk=next_stored,
            block_ids=blocks,
            keys=keys,
            prompt_offloadable=min(
                trace.prompt, trace.max_offload if trace.max_offload is not None else trace.prompt
            ),
            shared_prefix_boundary=trace.shared_prefix_boundary,
            keep_served_tails=False,  # vLLM's stores; kvstrata's extra tails are tested in unit tests
        )
        offered = [c.key for c in candidates]
        answer = _answer(rng, offered)
        script.answers = [answer]
        so = SimpleNamespace(
            num_scheduled_tokens={} if finished else {"req": scheduled},
            finished_req_ids={"req"} if finished else set(),
        )
        jobs = sched._build_store_jobs(so)
        vllm_offered = script.offers[offers_before] if len(script.offers) > offers_before else []
        where = f"step {step} of {trace}"
        assert vllm_offered == offered, where
        if not offered:
            answer = "all"
        if answer != "none":
            for g, n in advanced.items():
                next_stored[g] = max(next_stored[g], n)
        for pos, g in enumerate(layout.groups):
            assert vstate.group_states[pos].next_stored_chunk_idx == next_stored[g.index], where
        accepted = (
            []
            if answer in ("none", "empty")
            else [c for c in candidates if answer == "all" or c.key in answer]
        )
        if accepted:
            [job] = jobs.values()
            ids_, sizes, indices = _expected_src(layout, accepted)
            assert job.src_spec.block_ids.tolist() == ids_, where
            assert list(job.src_spec.group_sizes) == sizes, where
            for pos, size in enumerate(sizes):
                if size:
                    assert job.src_spec.block_indices[pos] == indices[pos], where
        else:
            assert not jobs, where
        stats["offers"] += bool(offered)
        stats["chunks"] += len(accepted)
        stats["drafter_held_back"] += sum(
            1
            for g in layout.groups
            if g.is_drafter and advanced[g.index] < offloadable // g.tokens_per_chunk
        )

    aborted = False
    while True:
        drafts = 0
        if computed < trace.prompt:  # chunked prefill
            scheduled = min(
                trace.prompt - computed, rng.randint(1, 3 * layout.scheduler_block_tokens)
            )
        else:  # decode: the last sampled token plus 0-3 draft tokens
            drafts = rng.randint(0, 3)
            scheduled = 1 + drafts
        request.num_computed_tokens = computed
        request.num_tokens = num_tokens
        for pos, g in enumerate(layout.groups):
            gb = blocks[g.index]
            if g.kind is GroupKind.SLIDING:
                _zero_stale_leading_blocks(g, gb, next_stored[g.index], rng)
                vstate.group_states[pos].block_ids[:] = gb
            new = _new_block_ids(g, len(gb), computed, computed + scheduled, ids, rng)
            gb.extend(new)
            vstate.group_states[pos].block_ids.extend(new)
        compare(scheduled, finished=False, aborted=False)
        step += 1
        if computed + scheduled < num_tokens:
            computed += scheduled
        else:
            # The step reached the end of the sequence: it samples a token, and in decode
            # accepts 0..drafts draft tokens (their KV was computed by this step).
            accepted = rng.randint(0, drafts)
            computed = num_tokens + accepted
            num_tokens = computed + 1
        if trace.abort_after_step is not None and step > trace.abort_after_step:
            aborted = True
            break
        if num_tokens >= trace.total:
            break  # the last sampled token stops the request; its KV is never computed
    request.status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
    request.is_finished.return_value = True
    request.num_computed_tokens = computed
    request.num_tokens = num_tokens
    compare(0, finished=True, aborted=aborted)
    return stats


def test_store_plans_match_vllm() -> None:
    rng = random.Random(7350)
    totals: Counter[str] = Counter()
    for trace_id in range(NUM_STORE_TRACES):
        trace = random_store_trace(rng, trace_id)
        totals += run_store_trace(trace, rng)
        totals[trace.family] += 1
    print(f"store differential: {NUM_STORE_TRACES} traces, {dict(totals)}")
    assert totals["chunks"] > 1000 and totals["drafter_held_back"] > 20
