"""Answers to nbpar.exercises, right and typically wrong, for tests/test_exercises.py."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def ring_all_reduce(t):
    """The reference: N-1 reduce-scatter steps, then N-1 all-gather steps, one chunk each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(t.chunk(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty_like(chunks[0])
    for step in range(world - 1):  # reduce-scatter: chunk (rank - step) travels right
        send = chunks[(rank - step) % world]
        recv_i = (rank - step - 1) % world
        req = dist.isend(send.contiguous(), right)
        dist.recv(buf, left)
        req.wait()
        chunks[recv_i] += buf
    for step in range(world - 1):  # all-gather: the finished chunks go round once more
        send = chunks[(rank + 1 - step) % world]
        recv_i = (rank - step) % world
        req = dist.isend(send.contiguous(), right)
        dist.recv(buf, left)
        req.wait()
        chunks[recv_i].copy_(buf)
    return t


def ring_without_all_gather(t):
    """Wrong: stops after the reduce-scatter half."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(t.chunk(world))
    buf = torch.empty_like(chunks[0])
    for step in range(world - 1):
        req = dist.isend(chunks[(rank - step) % world].contiguous(), (rank + 1) % world)
        dist.recv(buf, (rank - 1) % world)
        req.wait()
        chunks[(rank - step - 1) % world] += buf
    return t


def ring_whole_tensor(t):
    """Wrong: passes the whole tensor around the ring (right sum, N times the bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total, travelling = t.clone(), t.clone()
    buf = torch.empty_like(t)
    for _ in range(world - 1):
        req = dist.isend(travelling, (rank + 1) % world)
        dist.recv(buf, (rank - 1) % world)
        req.wait()
        travelling = buf.clone()
        total += travelling
    return total


def ring_with_all_reduce(t):
    """Wrong: not from send/recv at all."""
    dist.all_reduce(t)
    return t


def mean_all_reduce(t):
    """Wrong: averages."""
    dist.all_reduce(t)
    return t / dist.get_world_size()


def all_reduce_from_halves(t):
    world = dist.get_world_size()
    part = torch.empty(t.numel() // world)
    dist.reduce_scatter_tensor(part, t)
    dist.all_gather_into_tensor(t, part)
    return t


def halves_without_gather(t):
    """Wrong: the reduce-scatter alone."""
    part = torch.empty(t.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(part, t)
    return t


def shard_indices(n, rank, world, epoch, seed):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per_rank = -(-n // world)
    order += order[: per_rank * world - n]  # pad with the first indices
    return order[rank::world]


def shard_indices_no_epoch(n, rank, world, epoch, seed):
    """Wrong: forgets the epoch (no set_epoch)."""
    return shard_indices(n, rank, world, 0, seed)


def shard_indices_same_for_all(n, rank, world, epoch, seed):
    """Wrong: every rank reads rank 0's shard."""
    return shard_indices(n, 0, world, epoch, seed)


def shard_indices_unpadded(n, rank, world, epoch, seed):
    """Wrong: no padding, so ranks read different counts."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[rank::world]


def average_gradients(model):
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def sum_gradients(model):
    """Wrong: not divided by the world size."""
    for p in model.parameters():
        dist.all_reduce(p.grad)


def no_communication(model):
    """Wrong: leaves each rank's own gradients."""


def average_gradients_twice(model):
    """Wrong result-wise right, but every gradient all-reduced twice."""
    world = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
        dist.all_reduce(p.grad)
        p.grad /= world


def accumulate(model, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        sync = i == k - 1
        ctx = contextlib.nullcontext() if sync else model.no_sync()
        with ctx:
            (torch.nn.functional.mse_loss(model(x), y) / k).backward()


def accumulate_without_no_sync(model, micro_batches):
    """Wrong: DDP all-reduces after every micro-batch."""
    k = len(micro_batches)
    for x, y in micro_batches:
        (torch.nn.functional.mse_loss(model(x), y) / k).backward()


def accumulate_undivided(model, micro_batches):
    """Wrong: the micro-batch losses are not divided by their number."""
    for i, (x, y) in enumerate(micro_batches):
        ctx = contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync()
        with ctx:
            torch.nn.functional.mse_loss(model(x), y).backward()


def tp_mlp(x, w1_shard, w2_shard):
    y = torch.relu(x @ w1_shard.T) @ w2_shard.T  # column parallel, then row parallel
    dist.all_reduce(y)
    return y


def tp_mlp_no_all_reduce(x, w1_shard, w2_shard):
    """Wrong: the row-parallel linear's all-reduce is missing."""
    return torch.relu(x @ w1_shard.T) @ w2_shard.T


def tp_mlp_reduce_twice(x, w1_shard, w2_shard):
    """Wrong: an all-gather-like detour: all-reduces the output twice (and divides)."""
    y = torch.relu(x @ w1_shard.T) @ w2_shard.T
    dist.all_reduce(y)
    z = y.clone()
    dist.all_reduce(z)
    return z / dist.get_world_size()


def mesh(dp, tp):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def mesh_swapped(dp, tp):
    """Wrong: tp outer, so a tp group's ranks are strided across nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    m = init_device_mesh("cpu", (tp, dp), mesh_dim_names=("tp", "dp"))
    return m
