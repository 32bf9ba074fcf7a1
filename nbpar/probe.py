"""Client-side check of a config's model and data before any engine works.

`check_model(cfg, world)` builds the model and the data set in this process, runs
the first micro-batch forward and through the loss, checks that the model declares
what tensor/pipeline parallelism need, and that the estimated memory fits this
machine. Each failure is one line (ValueError) naming what to change.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from nbpar.model.data import build_dataset
from nbpar.model.models import build_model, loss_fn
from nbpar.model.plan import check_tp_degree, require
from nbpar.model.registry import display_name


def _shape(t) -> str:
    return (
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        if isinstance(t, torch.Tensor)
        else type(t).__name__
    )


def first_batch(cfg, model, dataset) -> None:
    """One micro-batch through the model and the loss, as the engines will run it."""
    name, data = display_name(cfg.model), cfg.dataset_name()
    if len(dataset) < 1:
        raise ValueError(f"dataset {data} is empty")
    item = dataset[0]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(
            f"dataset {data} must yield (input, target) pairs; its first item "
            f"is {type(item).__name__}"
            f"{f' of length {len(item)}' if hasattr(item, '__len__') else ''}"
        )
    x, y = next(iter(DataLoader(dataset, batch_size=min(cfg.micro_batch, len(dataset)))))
    with torch.no_grad():
        try:
            out = model(x)
        except Exception as e:
            raise ValueError(
                f"the first batch of dataset {data} (input {_shape(x)}) does not "
                f"fit model {name}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}"
            ) from None
        try:
            loss = loss_fn(cfg)(out, y)
        except ValueError as e:
            if "needs loss=" in str(e):
                raise
            loss = e
        except Exception as e:
            loss = e
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        why = (
            f"{type(loss).__name__}: {loss}"
            if isinstance(loss, Exception)
            else f"returned {_shape(loss)}, not a scalar"
        )
        raise ValueError(
            f"the loss of model {name} on dataset {data} (output {_shape(out)}, "
            f"target {_shape(y)}) failed: {why}"
        )


def check_plan(cfg, model, world: int) -> None:
    """What the strategy cuts must be declared by the model; tp must divide its widths."""
    dims = cfg.dims(world)
    if dims.tp > 1:
        check_tp_degree(model, dims.tp)
    if dims.pp > 1:
        layers = len(require(model, "pipeline").layers)
        if dims.pp > layers:
            raise ValueError(
                f"pp={dims.pp} pipeline stages need at least {dims.pp} blocks; "
                f"{display_name(cfg.model)} has {layers}"
            )


def check_fits(
    cfg,
    n_params: int,
    world: int,
    machine_bytes: int | None = None,
    *,
    pg_backend: str = "gloo",
    device_bytes: int | None = None,
) -> None:
    """Refuse a model whose estimated model states exceed the memory that holds them.
    On a CPU pool every rank's states share this machine's memory. On a GPU pool
    (``pg_backend`` "nccl") each rank's device states must fit one GPU
    (``device_bytes``, this host's first GPU by default; not checked where this process
    sees none), and what is offloaded to the host, all ranks together, this machine."""
    import psutil

    from nbpar import device
    from nbpar.estimate import estimate_config, format_bytes

    est = estimate_config(cfg, world, n_params)
    on_device, host = est.per_rank_bytes["total"], est.per_rank_bytes.get("host", 0)

    def refuse(need: int, where: str, than: str) -> ValueError:
        return ValueError(
            f"model {display_name(cfg.model)} ({n_params / 1e6:.1f}M parameters) needs "
            f"about {format_bytes(need)} for parameters, gradients and optimizer state "
            f"{where} with {cfg.strategy}, more than {than}"
        )

    have = machine_bytes if machine_bytes is not None else psutil.virtual_memory().total
    machine = f"this machine's {format_bytes(have)}"
    if pg_backend != "nccl":
        if (on_device + host) * world > have:
            raise refuse((on_device + host) * world, f"over {world} rank(s)", machine)
        return
    gpu = device_bytes if device_bytes is not None else device.total_memory(pg_backend)
    if gpu is not None and on_device > gpu:
        raise refuse(on_device, "per GPU", f"one GPU's {format_bytes(gpu)}")
    if host * world > have:  # what is offloaded lives in the host's memory
        raise refuse(host * world, f"offloaded to the host by {world} rank(s)", machine)


def check_model(cfg, world: int, pg_backend: str = "gloo") -> None:
    """All of the above for a validated ``cfg`` on ``world`` ranks of a pool on
    ``pg_backend``."""
    with torch.device("meta"):  # structure and size without allocating the weights
        shell = build_model(cfg)
    check_plan(cfg, shell, world)
    n_params = sum(p.numel() for p in shell.parameters())
    check_fits(cfg, n_params, world, pg_backend=pg_backend)
    dataset = build_dataset(cfg)
    try:  # shapes propagate on meta tensors: a 100M-parameter model costs nothing here
        first_batch(cfg, shell, _OnMeta(dataset))
    except ValueError:  # a real error, or an op meta tensors lack (.item()): run it for real
        first_batch(cfg, build_model(cfg), dataset)


class _OnMeta:
    """A data set whose tensors are on the meta device: a first batch through a meta
    model checks shapes without computing anything."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        if isinstance(item, (tuple, list)):
            return type(item)(t.to("meta") if isinstance(t, torch.Tensor) else t for t in item)
        return item
