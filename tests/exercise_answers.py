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
    dist.reduce_scatter_single(part, t)
    dist.all_gather_single(t, part)
    return t


def halves_without_gather(t):
    """Wrong: the reduce-scatter alone."""
    part = torch.empty(t.numel() // dist.get_world_size())
    dist.reduce_scatter_single(part, t)
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


def zero1_step(flat_params, flat_grad, lr, *, gather=True):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = flat_params.numel() // world
    mine = flat_params[rank * n : (rank + 1) * n].clone().requires_grad_()
    mine.grad = flat_grad[rank * n : (rank + 1) * n].clone()
    opt = torch.optim.Adam([mine], lr=lr)
    opt.step()
    if gather:
        out = torch.empty_like(flat_params)
        dist.all_gather_single(out, mine.detach())
    else:  # wrong: steps its slice and never gathers the others'
        out = flat_params.clone()
        out[rank * n : (rank + 1) * n] = mine.detach()
    return out, opt


def zero1_whole_adam(flat_params, flat_grad, lr):
    """Wrong: an Adam over the whole vector on every rank (that is DDP, not ZeRO-1)."""
    p = flat_params.clone().requires_grad_()
    p.grad = flat_grad.clone()
    opt = torch.optim.Adam([p], lr=lr)
    opt.step()
    return p.detach(), opt


def zero1_no_gather(flat_params, flat_grad, lr):
    """Wrong: steps its slice and never gathers the others'."""
    return zero1_step(flat_params, flat_grad, lr, gather=False)


def fully_shard_each(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def fully_shard_root_only(model):
    """Wrong: one unit for the whole model."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def memory(n_params, world, stage):
    split = [world if stage >= s else 1 for s in (3, 2, 1)]  # params, grads, optim
    return {
        "params": 2 * n_params / split[0],
        "grads": 2 * n_params / split[1],
        "optim": 12 * n_params / split[2],
    }


def memory_fp32(n_params, world, stage):
    """Wrong: fp32 training's bytes."""
    return {"params": 4 * n_params, "grads": 4 * n_params, "optim": 8 * n_params}


def memory_unsharded(n_params, world, stage):
    """Wrong: ignores the ZeRO stage."""
    return memory(n_params, world, 0)


def training_time(n_params, tokens, gpus, peak_flops, mfu):
    return 6 * n_params * tokens / (gpus * peak_flops * mfu)


def training_time_forward_only(n_params, tokens, gpus, peak_flops, mfu):
    """Wrong: 2 N D."""
    return 2 * n_params * tokens / (gpus * peak_flops * mfu)


def gpipe(stage, rank, data, group, *, send_back=True, divide=True, receive=True):
    m = len(data)
    if rank == 0:
        outs = []
        for x in data:
            h = stage(x)
            dist.send(h.detach().contiguous(), 1, group=group)
            outs.append(h)
        for h in outs:
            g = torch.empty_like(h)
            dist.recv(g, 1, group=group)
            h.backward(g)
        return
    ins, losses = [], []
    for y in data:
        h = torch.zeros(y.shape[0], 16)
        if receive:
            dist.recv(h, 0, group=group)
        h.requires_grad_()
        ins.append(h)
        loss = torch.nn.functional.mse_loss(stage(h), y)
        losses.append(loss / m if divide else loss)
    for h, loss in zip(ins, losses, strict=True):
        loss.backward()
        if send_back:
            dist.send(h.grad, 0, group=group)


def gpipe_no_grads_back(stage, rank, data, group):
    """Wrong: stage 1 never sends the boundary's gradients back."""
    return gpipe(stage, rank, data, group, send_back=False)


def gpipe_undivided(stage, rank, data, group):
    """Wrong: each micro-batch's loss not divided by their number."""
    return gpipe(stage, rank, data, group, divide=False)


def gpipe_never_receives(stage, rank, data, group):
    """Wrong: stage 1 never receives (it computes on zeros)."""
    return gpipe(stage, rank, data, group, receive=False)
