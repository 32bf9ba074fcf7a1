"""Where DeepSpeed's ZeRO-1/2 gradients live: the flat partition layout, by parameter.

DeepSpeed (``runtime/zero/stage_1_and_2.py``) flattens a parameter group into one buffer,
padded to a multiple of ``2 * dp`` elements (``nccl_start_alignment_factor`` 2 times the
data-parallel size), and gives rank r the slice [r * P, (r + 1) * P), P = padded / dp.
At the accumulation boundary a rank's reduced gradients sit in ``grads_in_partition``,
a buffer sized to the whole of every parameter that has an element in its slice
(``copy_grads_in_partition``: ``total_size += param_in_partition.numel()``); its
``averaged_gradients`` are views of it. So a rank holds Psi / dp plus the rest of the
parameters that straddle its slice's two edges: on 2 ranks, a 4,096-element matrix
across the middle of tiny_gpt is held whole by both, 17% over Psi / 2 on rank 1.
The fp32 master partition and the optimizer states are the exact slice. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from nbpar.checks import positive_int

ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor (4-byte alignment of fp16)


def partition_size(sizes: Sequence[int], dp: int) -> int:
    """Elements in each rank's slice of the flat, padded buffer of ``sizes``."""
    dp = positive_int("dp", dp)
    total = sum(sizes)
    align = ALIGNMENT_FACTOR * dp
    return -(-total // align) * align // dp


def gradient_elements_held(sizes: Sequence[int], dp: int, rank: int) -> int:
    """Gradient elements rank ``rank`` of ``dp`` holds at the boundary under DeepSpeed
    ZeRO-1/2 without offload: the whole of each parameter (sizes in the module's order)
    that has an element in its slice."""
    sizes = [positive_int("param_sizes[]", n) for n in sizes]
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp:
        raise ValueError(f"dp_rank must be an int in [0, {dp}), got {rank!r}.")
    size = partition_size(sizes, dp)
    lo, hi = rank * size, (rank + 1) * size
    held, start = 0, 0
    for n in sizes:
        if start < hi and start + n > lo:
            held += n
        start += n
    return held
