"""DeepSpeed's ZeRO-1/2 partition layout (`nbpar.ds_partition`), hand-computed."""

from __future__ import annotations

import pytest

from nbpar.ds_partition import gradient_elements_held, partition_size
from nbpar.estimate import estimate_memory


def test_a_parameter_across_the_edge_is_held_whole_by_both_ranks():
    # 12 elements, aligned to 2 * 2: slices [0, 6) and [6, 12); the middle one spans both
    assert partition_size([4, 4, 4], 2) == 6
    assert [gradient_elements_held([4, 4, 4], 2, r) for r in (0, 1)] == [8, 8]
    # parameters that end on the edge are held by one rank only
    assert [gradient_elements_held([6, 3, 3], 2, r) for r in (0, 1)] == [6, 6]


def test_padding_to_twice_dp():
    # 5 elements pad to 8 on 2 ranks (slices of 4): the one parameter is on both
    assert partition_size([5], 2) == 4
    assert [gradient_elements_held([5], 2, r) for r in (0, 1)] == [5, 5]
    # 10 elements on 4 ranks pad to 16 (slices of 4): the last rank holds only padding
    assert partition_size([3, 7], 4) == 4
    assert [gradient_elements_held([3, 7], 4, r) for r in range(4)] == [10, 7, 7, 0]


def test_the_estimate_uses_the_layout_only_where_deepspeed_has_it():
    sizes = [4, 4, 4]
    kw = dict(param_sizes=sizes, dp_rank=1, backend="deepspeed")
    assert estimate_memory(12, 2, "zero1", **kw).per_rank_bytes["grads"] == 4 * 8
    assert estimate_memory(12, 2, "zero2", **kw).per_rank_bytes["grads"] == 4 * 8
    # ZeRO-3's flat gradient partition and the torch backend follow Psi / dp
    assert estimate_memory(12, 2, "zero3", **kw).per_rank_bytes["grads"] == 4 * 6
    torch_kw = dict(kw, backend="torch")
    assert estimate_memory(12, 2, "zero2", **torch_kw).per_rank_bytes["grads"] == 4 * 6


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda: gradient_elements_held([4, 4], 2, 2), "dp_rank"),
        (lambda: gradient_elements_held([4, 0], 2, 0), "param_sizes"),
        (lambda: partition_size([4], 0), "dp"),
        (
            lambda: estimate_memory(10, 2, "zero1", backend="deepspeed", param_sizes=[4, 4]),
            "param_sizes must add up",
        ),
    ],
)
def test_bad_layout_input_is_named(call, word):
    with pytest.raises(ValueError, match=word):
        call()
