from tests.distributed import run_distributed


def _all_reduce(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_all_reduce_on_two_processes():
    assert run_distributed(_all_reduce, 2) == [3.0, 3.0]


def test_failure_names_the_rank():
    import pytest

    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*boom on rank 1"):
        run_distributed(_fail_on_one, 2, timeout=60)
