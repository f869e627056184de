"""``swap_blocks_batch`` as vLLM 0.32.0's ``_custom_ops`` wraps it on CUDA, over vLLM's own op:
``_C_stable_libtorch.abi3.so`` from the vllm-0.32.0 wheel (built on torch's stable ABI, so it
loads into the machine's torch), unpacked next to this file by run.sh."""

import os

import torch

torch.ops.load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "_C_stable_libtorch.abi3.so"))


def swap_blocks_batch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                      is_src_access_order_any: bool = False) -> None:
    torch.ops._C_cache_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)
