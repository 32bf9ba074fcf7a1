"""Save, resume and consolidate training checkpoints (engine side).

Every torch runner (single, DDP, ZeRO-1, FSDP2, tensor parallel, pipeline
stages) is saved through torch.distributed.checkpoint (DCP): `get_state_dict`
names every tensor by its fully qualified name in the unwrapped model, so a
checkpoint written on 2 DDP ranks loads on 1 process or into FSDP2/DTensor
shards (resharding). A pipeline runner's ModuleList of stage chunks is merged
back under the full model's names; ZeRO-1 saves its local optimizer partition.
A runner with a DeepSpeed ``engine`` goes through ``engine.save_checkpoint`` /
``load_checkpoint`` (same layout only). Any other runner plugs in with::

    checkpoint_format = "name"   # recorded in meta.json
    def save_checkpoint(self, path: str, *, distributed: bool) -> None
    def load_checkpoint(self, path: str, *, distributed: bool) -> None

Writes go to a temp folder renamed after every rank finished, then the
``latest`` pointer flips atomically (see `nbpar.checkpoint_meta` for the layout).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nbpar import device
from nbpar.checkpoint_meta import (
    FORMAT_VERSION,
    LATEST,
    META,
    check_resume,
    checkpoint_format,
    list_checkpoints,
    model_signature,
    read_meta,
    resolve,
    step_name,
)
from nbpar.files import atomic_path, atomic_write_text, fsync_dir
from nbpar.model.registry import json_fields

if TYPE_CHECKING:
    from nbpar.train.context import RankContext

# per-FQN optimizer keys (also param_groups): ranks holding different parameters
# (pipeline stages, ZeRO-1 partitions) never collide, and any layout can read them
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
DS_TAG = "ds"  # DeepSpeed's files live in step_*/ds/

__all__ = ["save", "resume", "consolidate", "resolve", "check_resume", "read_meta"]


# ---- the default (DCP) state of a runner ---------------------------------------
def merge_chunks(chunks) -> nn.Module:
    """One module over pipeline stage chunks (copies of the model keeping their part,
    names unchanged), sharing their parameters, so FQNs are the full model's."""
    merged = nn.Module()
    layers = nn.ModuleDict()
    for chunk in chunks:
        for name, child in chunk.named_children():
            if name == "layers":
                layers.update(child)
            else:
                setattr(merged, name, child)
    merged.layers = layers
    return merged


def _targets(runner):
    """(model, optimizer) whose FQN state DCP saves. A pipeline runner's ModuleList
    of chunks is merged; ZeRO-1's local optimizer holds this rank's partition, so
    its state is saved per parameter by its owner."""
    model, optimizer = runner.model, runner.optimizer
    if isinstance(model, nn.ModuleList):
        model = merge_chunks(model)
    if optimizer.__class__.__name__ == "ZeroRedundancyOptimizer":
        optimizer = optimizer.optim
    return model, optimizer


@contextlib.contextmanager
def _quiet(distributed: bool):
    """DCP warns that one process means no process group: that is what single means."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_save(runner, path: str, *, distributed: bool) -> None:
    """Write this rank's model and optimizer shards under ``path`` (a collective)."""
    model, optimizer = _targets(runner)
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS)
    with _quiet(distributed):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=not distributed)


def dcp_load(runner, path: str, *, distributed: bool) -> None:
    """Read model and optimizer state from ``path`` into this rank's (sharded) tensors."""
    model, optimizer = _targets(runner)
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": msd, "optim": osd}
    with _quiet(distributed):
        dcp.load(state, checkpoint_id=path, no_dist=not distributed)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=OPTIONS,
    )


def deepspeed_save(runner, path: str, *, distributed: bool) -> None:
    """DeepSpeed writes its own files (ZeRO partitions per rank) under ``path``/ds."""
    runner.engine.save_checkpoint(path, tag=DS_TAG, save_latest=False)


def deepspeed_load(runner, path: str, *, distributed: bool) -> None:
    runner.engine.load_checkpoint(
        path, tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
    )


def _hooks(runner):
    """(save, load) of ``runner``: its own methods, DeepSpeed's engine, or DCP."""
    if hasattr(runner, "save_checkpoint") and hasattr(runner, "load_checkpoint"):
        return runner.save_checkpoint, runner.load_checkpoint
    if hasattr(getattr(runner, "engine", None), "save_checkpoint"):
        return (
            lambda p, **kw: deepspeed_save(runner, p, **kw),
            lambda p, **kw: deepspeed_load(runner, p, **kw),
        )
    return (lambda p, **kw: dcp_save(runner, p, **kw), lambda p, **kw: dcp_load(runner, p, **kw))


def _save_state(runner, path, ctx: RankContext):
    _hooks(runner)[0](path, distributed=ctx.distributed)


def _load_state(runner, path, ctx: RankContext):
    _hooks(runner)[1](path, distributed=ctx.distributed)


# ---- save ---------------------------------------------------------------------
def _barrier(ctx: RankContext) -> None:
    if ctx.distributed:
        dist.barrier()


def _rng_file(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, "rng", f"rank_{rank:05d}.pt")


def save(cfg, runner, step: int, position: dict, ctx: RankContext) -> str:
    """Write checkpoint ``step`` of this run on every rank; return its folder.

    ``position`` is the data position, ``{"epoch", "batches_in_epoch"}`` of this
    rank's loader. Rank 0 renames the finished temp folder and flips ``latest``
    only after a barrier, then prunes all but the newest ``cfg.checkpoint_keep``.
    """
    root = os.path.abspath(cfg.checkpoint_dir)
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, f".tmp-{step_name(step)}")
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier(ctx)
    _save_state(runner, tmp, ctx)
    torch.save(device.rng_state(ctx.backend), _rng_file(tmp, ctx.rank))  # CPU (+ GPU)
    _barrier(ctx)  # every shard and RNG file is on disk
    if ctx.rank == 0:
        meta = _meta(cfg, runner, step, position, ctx)
        atomic_write_text(os.path.join(tmp, META), json.dumps(meta, indent=1, sort_keys=True))
        promote(root, tmp, final)
        prune(root, cfg.checkpoint_keep)
    _barrier(ctx)
    return final


def _meta(cfg, runner, step: int, position: dict, ctx: RankContext) -> dict:
    """meta.json of checkpoint ``step``: what was trained, on which layout, and where the
    data continues (the global sample count, so another dp degree resumes there too)."""
    dims = ctx.dims
    return {
        "version": FORMAT_VERSION,
        "step": step,
        "format": getattr(runner, "checkpoint_format", checkpoint_format(cfg)),
        "world_size": ctx.world,
        "dims": {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp},
        # a factory callable is written as its "module:name" (importable unless __main__)
        "config": {**json_fields(cfg.to_dict()), "resume_from": None},
        "model": model_signature(cfg),
        "global_batch": cfg.global_batch(ctx.world),
        "data": {
            "epoch": position["epoch"],
            "samples_in_epoch": position["batches_in_epoch"] * cfg.micro_batch * dims.dp,
        },
        "time": time.time(),
    }


def promote(root: str, tmp: str, final: str) -> None:
    """Rename the complete ``tmp`` onto ``final``, then point ``latest`` at it."""
    if os.path.exists(final):  # the same step written again (a rerun from an earlier point)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST), os.path.basename(final))


def prune(root: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names)."""
    with open(os.path.join(root, LATEST)) as f:
        current = os.path.join(root, f.read().strip())
    done = list_checkpoints(root)
    for _, path in done[: max(0, len(done) - keep)]:
        if path != current:
            shutil.rmtree(path, ignore_errors=True)


# ---- resume -------------------------------------------------------------------
def resume(cfg, runner, batches, ctx: RankContext) -> int:
    """Load ``cfg.resume_from`` into ``runner``, seek ``batches``; return the next step.

    The same checks as on the client run again here (a ``%%dist`` user has no
    client), then model + optimizer state, this rank's RNG state when the world
    size is unchanged, and the data position: the epoch and the micro-batches
    this rank's loader had consumed (derived from the global sample count, so a
    different dp degree with the same global batch continues at the same sample).
    """
    meta = check_resume(cfg, ctx.world)
    step_dir = meta["path"]
    _load_state(runner, step_dir, ctx)
    rng = _rng_file(step_dir, ctx.rank)
    if meta["world_size"] == ctx.world and os.path.isfile(rng):
        device.set_rng_state(torch.load(rng, map_location="cpu", weights_only=True), ctx.backend)
    per_round = cfg.micro_batch * ctx.dims.dp
    batches.seek(meta["data"]["epoch"], meta["data"]["samples_in_epoch"] // per_round)
    return int(meta["step"])


# ---- consolidate --------------------------------------------------------------
def consolidate(checkpoint_path, out_file) -> str:
    """Write the full model weights of a checkpoint to one file.

    ``checkpoint_path`` is a ``step_*`` folder or a checkpoint_dir (its
    ``latest``). The file holds a plain ``{name: tensor}`` dict for
    ``nbpar.model.models.build_model(cfg).load_state_dict``: a name ending in
    ``.safetensors`` is written with safetensors (tensors and a JSON header, no pickle,
    so loading it runs no code; ``safetensors.torch.load_file``), any other with
    ``torch.save`` (``torch.load(out_file, weights_only=True)``). Runs in one process.
    """
    from nbpar.config import TrainConfig
    from nbpar.model.models import build_model

    step_dir = resolve(checkpoint_path)
    meta = read_meta(step_dir)
    cfg = TrainConfig.from_dict(meta["config"])
    if meta["format"] == "deepspeed":
        full = _deepspeed_weights(step_dir)
    else:
        model = build_model(cfg)
        full = model.state_dict()
        with _quiet(False):
            dcp.load({"model": full}, checkpoint_id=step_dir, no_dist=True)
    full = {k: v.detach().to("cpu").clone() for k, v in full.items()}
    out_file = os.fspath(out_file)
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    with atomic_path(out_file) as tmp:
        _write_weights(full, tmp, safetensors=out_file.endswith(".safetensors"))
    return out_file


def _write_weights(state: dict, path: str, *, safetensors: bool) -> None:
    if not safetensors:
        torch.save(state, path)
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError(
            "a .safetensors export needs the safetensors package: `pip install safetensors`"
        ) from None
    # one contiguous buffer per tensor ("format": "pt" is what transformers looks for)
    save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})


def _deepspeed_weights(step_dir: str) -> dict:
    """fp32 weights of a DeepSpeed checkpoint: ZeRO partitions merged, or (stage 0)
    the module state the engine saved whole."""
    import glob

    from nbpar.parallel.deepspeed import import_deepspeed

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if glob.glob(os.path.join(step_dir, DS_TAG, "*optim_states.pt")):
        return get_fp32_state_dict_from_zero_checkpoint(step_dir, tag=DS_TAG)
    states = torch.load(  # GPU tensors land on the CPU: consolidating needs no GPU
        os.path.join(step_dir, DS_TAG, "mp_rank_00_model_states.pt"),
        map_location="cpu",
        weights_only=False,  # DeepSpeed pickles its config objects too
    )
    return {k: v.float() for k, v in states["module"].items()}
