"""A plain DDP training script, the way one writes it for torchrun: the baseline.

    torchrun --standalone --nproc_per_node 2 benchmarks/plain_ddp.py --steps 40

Same model, data, batch and threads per process as ``nbpar train --strategy ddp``.
First an untimed run of ``--warmup-steps`` steps (one-off costs of a fresh process,
such as the first optimizer step's imports, paid as in nbpar's warmed pool).
Rank 0 prints one JSON line:

- ``wall_s``: from a barrier after ``init_process_group`` (torch imported, group up:
  the state of a started nbpar pool) to a barrier after the last step: building the
  model, DDP, optimizer and data loader, then ``--steps`` steps (each with the loss
  all-reduced, as nbpar reports the global loss);
- ``loop_s``: wall clock from the end of the first step to the end of the last
  (the slowest rank's), the same window `ddp_vs_torchrun.py` reads from nbpar's records;
- ``step_time_s``: the median step (data loading excluded, as in nbpar).
"""

import argparse
import json
import statistics
import time

import torch.distributed as dist

from nbpar.config import GPTConfig, TrainConfig
from nbpar.train.ddp_script import batches, build, exit_now, setup


def train(args, dev, device_ids) -> tuple[list[float], list[float], float]:
    """Build everything and run the steps: (step times, wall clock at each step's end,
    the last step's loss of the global batch). The DDP recipe's own pieces
    (`nbpar.train.ddp_script`), with a timer around each step."""
    cfg = TrainConfig(
        model=args.model,
        strategy="ddp",
        micro_batch=args.micro_batch,
        steps=args.steps,
        gpt=GPTConfig(d_model=args.d_model, n_layers=args.layers, seq_len=args.seq_len),
    )
    model, opt, criterion, loader = build(cfg, dev, device_ids)
    data = batches(loader, dev)
    world = dist.get_world_size()
    times, ends = [], []
    for _ in range(args.steps):
        x, y = next(data)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        report = loss.detach().reshape(1)
        dist.all_reduce(report)
        last = report.item() / world
        times.append(time.perf_counter() - t)
        ends.append(time.time())
    return times, ends, last


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=2, help="an untimed run first (0: none)")
    args = p.parse_args()
    # the process group, the device and, on CPU, nbpar's rule for threads per process
    dev, device_ids = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.warmup_steps:  # as nbpar's pool is warmed: one short run first, not timed
        warm = argparse.Namespace(**{**vars(args), "steps": args.warmup_steps})
        train(warm, dev, device_ids)
    dist.barrier()
    start = time.perf_counter()
    times, ends, last = train(args, dev, device_ids)
    dist.barrier()
    wall = time.perf_counter() - start
    loops = [None] * world
    dist.all_gather_object(loops, ends[-1] - ends[0])
    if rank == 0:
        print(
            json.dumps(
                {
                    "wall_s": wall,
                    "loop_s": max(loops),
                    "step_time_s": statistics.median(times[1:] or times),
                    "last_loss": last,
                }
            )
        )
    dist.destroy_process_group()
    exit_now()  # torch 2.13's gloo can abort in the interpreter's teardown (ddp_script)


if __name__ == "__main__":
    main()
