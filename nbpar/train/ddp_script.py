"""The DDP recipe as a standalone script for torchrun: what ``pool.train(strategy="ddp")``
does, written out the way a cluster job runs it.

    torchrun --standalone --nproc_per_node 2 train_ddp.py [--config config.json] [--out w.pt]

torchrun starts ``--nproc_per_node`` processes per node and gives each one ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
in its environment; ``init_process_group`` reads them. With GPUs each process binds GPU
``LOCAL_RANK`` of its node and the group uses nccl; without, gloo on CPU. Model, data and
optimizer are nbpar's for the config, so the result can be compared with ``pool.train``:
`write_script` puts this file and a config next to each other in any folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nbpar import device
from nbpar.config import TrainConfig
from nbpar.model.data import build_loader
from nbpar.model.models import build_model, loss_fn
from nbpar.model.registry import json_fields
from nbpar.parallel.common import make_optimizer

SCRIPT, CONFIG = "train_ddp.py", "config.json"


def setup() -> tuple[torch.device, list[int] | None]:
    """Join the process group torchrun describes; return (device, DDP's device_ids)."""
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = device.default_backend()  # nccl with GPUs, gloo without
    dist.init_process_group(backend)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # one GPU per process, before any CUDA work
        return device.current_device(backend), [local_rank]
    # CPU: the cores shared out between this node's processes (nbpar's engines do the same)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    return torch.device("cpu"), None


def build(cfg: TrainConfig, dev, device_ids):
    """(DDP model, optimizer, loss function, this rank's loader) for ``cfg``."""
    model = DDP(build_model(cfg).to(dev), device_ids=device_ids)  # broadcasts rank 0's weights
    optimizer = make_optimizer(model.parameters(), cfg)
    loader = build_loader(cfg, dist.get_rank(), dist.get_world_size())  # DistributedSampler
    return model, optimizer, loss_fn(cfg), loader


def batches(loader, dev):
    """Endless batches on ``dev``; every new epoch reshuffles through ``set_epoch``."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        for x, y in loader:
            yield x.to(dev), y.to(dev)
        epoch += 1


def train(cfg: TrainConfig, dev, device_ids, log_every: int = 5) -> tuple[torch.nn.Module, list]:
    """``cfg.steps`` DDP steps; returns the trained module and the global loss per step."""
    model, optimizer, criterion, loader = build(cfg, dev, device_ids)
    rank, world, losses = dist.get_rank(), dist.get_world_size(), []
    for step, (x, y) in zip(range(cfg.steps), batches(loader, dev)):
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
        optimizer.step()
        report = loss.detach().reshape(1)
        dist.all_reduce(report)  # the loss of the global batch, for the log
        losses.append(report.item() / world)
        if rank == 0 and (step % log_every == 0 or step == cfg.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.2f}", flush=True)  # rank 0 logs
    return model.module, losses


def main(argv=None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(here, CONFIG), help="a TrainConfig as JSON")
    p.add_argument("--out", default=None, help="rank 0 saves the trained state dict here")
    args = p.parse_args(argv)
    with open(args.config) as f:
        cfg = TrainConfig.from_dict(json.load(f))
    dev, device_ids = setup()
    try:
        model, losses = train(cfg, dev, device_ids)
        if dist.get_rank() == 0:
            if args.out:
                torch.save(model.state_dict(), args.out)
            print(json.dumps({"losses": losses}), flush=True)
        dist.barrier()  # all ranks leave together: none closes its links while one still works
    finally:
        dist.destroy_process_group()
    exit_now()


def exit_now() -> None:
    """End this process at once, its output flushed, skipping the interpreter's teardown:
    with torch 2.13 on gloo a DDP process aborts there about one run in ten ("terminate
    called without an active exception", after its work is done and its group destroyed),
    and torchrun then reports the run as failed. Only a run that succeeded gets here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_script(cfg: TrainConfig, folder) -> str:
    """Write this recipe as ``folder/train_ddp.py`` with ``cfg`` as ``folder/config.json``;
    return the script's path. Only what the recipe does is accepted: DDP, fp32, one
    micro-batch per step, no clipping, schedule or checkpoints."""
    unsupported = {
        "strategy": cfg.strategy != "ddp",
        "backend": cfg.backend != "torch",
        "precision": cfg.precision != "fp32",
        "grad_accum": cfg.grad_accum != 1,
        "grad_clip": bool(cfg.grad_clip),
        "lr_schedule": bool(cfg.lr_schedule),
        "checkpoint_dir": cfg.checkpoint_dir is not None or cfg.resume_from is not None,
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(
            f"the torchrun recipe covers plain fp32 DDP steps only; not {', '.join(bad)} "
            f"(use pool.train or `nbpar train` for those)"
        )
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    script = os.path.join(folder, SCRIPT)
    shutil.copyfile(os.path.abspath(__file__), script)
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(json_fields(cfg.to_dict()), f, indent=1)  # a factory as "module:name"
    return script


if __name__ == "__main__":
    main()
