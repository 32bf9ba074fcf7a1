"""A plain DDP training script, the way one writes it for torchrun: the baseline.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/plain_ddp.py --steps 60

Same model, data and batch as ``nbpar train --strategy ddp``; prints one JSON
line from rank 0 with the median step time (data loading excluded, as in nbpar).
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nbpar.config import GPTConfig, TrainConfig
from nbpar.train.data import build_loader
from nbpar.train.models import build_model, loss_fn


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--model", default="tiny_gpt")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (torch.get_num_threads()) // world))
    cfg = TrainConfig(model=args.model, strategy="ddp", micro_batch=args.micro_batch,
                      steps=args.steps, gpt=GPTConfig(d_model=args.d_model, n_layers=args.layers,
                                                      seq_len=args.seq_len))
    model = DDP(build_model(cfg))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    criterion = loss_fn(cfg.model)
    loader = build_loader(cfg, rank, world)
    batches = iter(loader)
    times = []
    for _ in range(args.steps):
        x, y = next(batches)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        report = loss.detach().reshape(1)
        dist.all_reduce(report)
        times.append(time.perf_counter() - t)
    if rank == 0:
        print(json.dumps({"step_time_s": statistics.median(times[5:])}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
