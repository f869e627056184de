"""KV cache events from a real multiprocess engine, received over vLLM's ZMQ publisher as a
KV-aware router receives them: kvstrata's tiers with self-describing payloads, across a restart
(the restarted engine announces what its disk holds)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from e2e_harness import CASES, PROMPTS, generate_step, run_phase, token_ids
from kv_event_payloads import described_blocks


class Subscriber:
    """Collects every event batch published on ``endpoint`` (a router's SUB socket)."""

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)  # reconnects to each engine that binds it
        self.batches: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                batch = self._decoder.decode(payload)
                with self._lock:
                    self.batches.append(batch)

    def take(self) -> list[Any]:
        with self._lock:
            out, self.batches = self.batches, []
        return [e for b in out for e in b.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()


def _stored(events: list[Any], medium: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == medium]


def _chunk_hashes(stored: list[Any]) -> set[Any]:
    """The chunk keys' hashes in ``BlockStored`` events: a placeholder names each chunk by its
    key's hash; a described event is one chunk, whose key hash is its last block's."""
    out: set[Any] = set()
    for e in stored:
        out.update([e.block_hashes[-1]] if e.token_ids else e.block_hashes)
    return out


@pytest.mark.slow
def test_self_describing_events_over_zmq_across_a_restart(tmp_path: Path) -> None:
    case = CASES["llama"]
    model_dir = case.build(tmp_path / "model", 0)
    endpoint = f"ipc://{tmp_path}/kv-events"
    opts = case.options(
        model_dir, tmp_path / "store", multiprocess=True,
        extra_config={"self_describing_kv_events": True},
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint})
    tick = generate_step("tick", [[5, 6, 7]])  # a step that publishes what the disk reported since
    sub = Subscriber(endpoint)
    try:
        # Every chunk of the prompts (full chunks, and each prompt's tail) reaches the disk before
        # the tick publishes what the disk reported: waited for in the store itself. The tick's
        # own tail is stored too; the phase ends by waiting for it and ticking once more (its
        # chunk is stored by then, so nothing new), else its event could be left unpublished
        # while the restart announces it.
        chunk = case.chunk
        full = {tuple(p[: (i + 1) * chunk]) for p in PROMPTS for i in range(len(p) // chunk)}
        tails = {tuple(p) for p in PROMPTS if len(p) % chunk}
        written = {"op": "wait_disk_entries", "path": str(tmp_path / "store"),
                   "at_least": len(full) + len(tails), "timeout_s": 120}
        with_tick = {**written, "at_least": len(full) + len(tails) + 1}
        first = run_phase(opts, [generate_step("cold"), written, tick,
                                 {"op": "reset_prefix_cache"}, generate_step("host"),
                                 with_tick, {**tick, "name": "last_tick"}],
                          tmp_path / "first.log")
        events_1 = sub.take()
        restart = run_phase(opts, [{"op": "drop_page_cache", "required": True}, generate_step("disk")],
                            tmp_path / "restart.log")
        events_2 = sub.take()
    finally:
        sub.close()
    assert token_ids(first["host"]) == token_ids(first["cold"])
    assert token_ids(restart["disk"]) == token_ids(first["cold"])

    # vLLM's own GPU events name every full block of the prompts with its tokens.
    gpu = described_blocks(_stored(events_1, "GPU"))
    block = next(e.block_size for e in _stored(events_1, "GPU"))
    assert len(gpu) == len({tuple(p[: (i + 1) * block]) for p in PROMPTS for i in range(len(p) // block)})
    for medium in ("CPU", "STORAGE"):
        described = [e for e in _stored(events_1, medium) if e.token_ids]
        assert described_blocks(described) == gpu, medium
    # The restarted engine promotes the prompts from disk and describes them as well.
    promoted = [e for e in _stored(events_2, "CPU") if e.token_ids]
    assert described_blocks(promoted) == gpu
    # Before that, it announced every chunk its disk holds, so a router knows what it can serve
    # from the moment it starts. Events are translated when a step publishes them: a chunk the
    # first requests looked up by then is described, the others keep the placeholder.
    first_promotion = events_2.index(_stored(events_2, "CPU")[0])
    announced = _stored(events_2[:first_promotion], "STORAGE")
    stored_1 = _stored(events_1, "STORAGE")
    assert stored_1 and _chunk_hashes(announced) == _chunk_hashes(stored_1)
    described = described_blocks([e for e in announced if e.token_ids])
    assert described, "no announced chunk was described (the first requests looked them all up)"
    assert all(gpu[h] == payload for h, payload in described.items())
