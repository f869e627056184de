"""A synthetic vLLM-shaped KV cache with a stager over it, for the staging benchmarks.

``bench tiers`` (host staging on CPU) and ``gpu_check`` (the same on an accelerator) time the
same thing: a job of whole chunks moved between randomly placed KV blocks and a host slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvstrata.tiers.device import DeviceStager, Transfer
    from kvstrata.tiers.host import HostSlab


@dataclass
class SyntheticKV:
    raw: torch.Tensor  # every layer's pages, one int8 buffer (vLLM's layer-outer placement)
    caches: dict[str, torch.Tensor]  # layer name -> [num_blocks, kv_heads, block_tokens, 2 * head]
    page: int  # bytes of one layer's block
    num_blocks: int
    blocks_per_chunk: int
    chunks: int

    @property
    def shard_bytes(self) -> int:
        """Bytes of one chunk of every layer (one host slot)."""
        return len(self.caches) * self.blocks_per_chunk * self.page

    @property
    def job_bytes(self) -> int:
        return self.chunks * self.shard_bytes

    def stager(self, slab: HostSlab) -> DeviceStager:
        from kvstrata.tiers.device import make_stager

        return make_stager(self.caches, [list(self.caches)], slab, num_blocks=self.num_blocks,
                            blocks_per_chunk=self.blocks_per_chunk, shard_bytes=self.shard_bytes)

    def transfers(self, seed: int = 0) -> list[Transfer]:
        """One chunk per slot, its blocks scattered over the cache (block 0 is vLLM's null)."""
        import numpy as np

        from kvstrata.tiers.device import Transfer

        bpc, chunks = self.blocks_per_chunk, self.chunks
        ids = np.random.default_rng(seed).permutation(self.num_blocks - 1)[: chunks * bpc] + 1
        return [Transfer(0, c, 0, ids[c * bpc : (c + 1) * bpc].tolist()) for c in range(chunks)]


def synthetic_kv(*, layers: int, kv_heads: int, block_tokens: int, head_size: int,
                 blocks_per_chunk: int, chunks: int, device: str = "cpu") -> SyntheticKV:
    """Random bf16 pages, K and V packed in the last dim, room for twice the job's blocks."""
    import torch

    page = kv_heads * block_tokens * 2 * head_size * 2
    num_blocks = 2 * chunks * blocks_per_chunk + 1
    raw = torch.randint(-128, 128, (layers * num_blocks * page,), dtype=torch.int8, device=device)
    caches = {
        f"layer{li}": raw[li * num_blocks * page : (li + 1) * num_blocks * page]
        .view(torch.bfloat16)
        .view(num_blocks, kv_heads, block_tokens, 2 * head_size)
        for li in range(layers)
    }
    return SyntheticKV(raw, caches, page, num_blocks, blocks_per_chunk, chunks)
