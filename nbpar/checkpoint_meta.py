"""Checkpoint layout, the ``meta.json`` beside the shards, and resume checks.

Layout under ``checkpoint_dir``::

    step_000010/         one complete checkpoint: DCP shards (or DeepSpeed's files),
      meta.json          step, config, world size, dims, model fingerprint, data position
      rng/rank_00000.pt  per-rank torch RNG state
    latest               the name of the newest complete checkpoint ("step_000010")

A checkpoint is written under ``.tmp-step_000010`` and renamed when every rank
finished; ``latest`` is replaced atomically after that, so a crash mid-save
leaves the previous ``latest`` valid. This module never imports torch at import
time: the client runs `check_resume` before any engine works.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

META = "meta.json"
LATEST = "latest"
FORMAT_VERSION = 1
STEP_RE = re.compile(r"^step_(\d{6,})$")
GPT_FIELDS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "ffn_mult")


def step_name(step: int) -> str:
    """``step_000010`` for step 10."""
    return f"step_{step:06d}"


def checkpoint_format(cfg) -> str:
    """How ``cfg``'s runner writes its state: "deepspeed" (engine files) or "dcp"."""
    return "deepspeed" if cfg.backend == "deepspeed" else "dcp"


def list_checkpoints(checkpoint_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints (``step_*`` folders with a meta.json), oldest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    out = []
    for name in os.listdir(checkpoint_dir):
        m = STEP_RE.match(name)
        path = os.path.join(checkpoint_dir, name)
        if m and os.path.isfile(os.path.join(path, META)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(checkpoint_dir: str) -> str | None:
    """The folder ``checkpoint_dir/latest`` names, or None when there is no pointer."""
    pointer = os.path.join(checkpoint_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    if not STEP_RE.match(name):
        raise ValueError(
            f"checkpoint pointer {pointer} is corrupt: it holds {name[:40]!r}, "
            f"expected a name like 'step_000010'"
        )
    return os.path.join(checkpoint_dir, name)


def resolve(path) -> str:
    """The checkpoint folder meant by ``path``: a ``step_*`` folder, or a checkpoint_dir
    whose ``latest`` names one. FileNotFoundError/ValueError name the path."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"resume_from must be a path (str), got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if os.path.isfile(os.path.join(path, META)):
        return path
    step_dir = latest(path) if os.path.isdir(path) else None
    if step_dir is None:
        raise ValueError(
            f"{path} is not a checkpoint: it has neither {META} nor a '{LATEST}' pointer"
        )
    if not os.path.isfile(os.path.join(step_dir, META)):
        raise FileNotFoundError(
            f"checkpoint pointer {os.path.join(path, LATEST)} names "
            f"{step_dir}, which is missing or incomplete"
        )
    return step_dir


def read_meta(step_dir: str) -> dict:
    """The parsed ``meta.json`` of ``step_dir``; ValueError when it is corrupt."""
    file = os.path.join(step_dir, META)
    try:
        with open(file) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {step_dir} has no {META}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint metadata {file} is corrupt ({e})") from None
    need = (
        "version",
        "step",
        "format",
        "world_size",
        "dims",
        "config",
        "model",
        "global_batch",
        "data",
    )
    missing = [k for k in need if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(f"checkpoint metadata {file} is corrupt: missing {', '.join(missing)}")
    if meta["version"] != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {step_dir} has format version {meta['version']}, this "
            f"nbpar reads version {FORMAT_VERSION}"
        )
    return meta


def model_signature(cfg) -> dict:
    """Parameter names and shapes of ``build_model(cfg)`` and their hash (meta device:
    no memory, no weights)."""
    import torch

    from nbpar.model.models import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    digest = hashlib.sha256(json.dumps(sorted(shapes.items())).encode()).hexdigest()[:16]
    from nbpar.model.registry import display_name

    return {"name": display_name(cfg.model), "fingerprint": digest, "shapes": shapes}


def _model_mismatch(where: str, meta: dict, cfg) -> str:
    old, new = meta["config"], cfg.to_dict()
    if old.get("model") != new["model"]:
        diff = f"model {old.get('model')}, this config builds {new['model']}"
    else:
        og, ng = old.get("gpt") or {}, new["gpt"]
        keys = [k for k in GPT_FIELDS if og.get(k) != ng[k]] if new["model"] == "tiny_gpt" else []
        diff = (
            (
                f"model {new['model']} "
                + " ".join(f"{k}={og.get(k)}" for k in keys)
                + ", this config builds "
                + " ".join(f"{k}={ng[k]}" for k in keys)
            )
            if keys
            else f"a model with fingerprint {meta['model'].get('fingerprint')}, this config "
            f"builds a different one"
        )
    return f"checkpoint at {where} was written by {diff}"


def check_resume(cfg, world_size: int | None = None) -> dict:
    """Everything about ``cfg.resume_from`` that can be checked before engines work.

    Raises FileNotFoundError (missing path) or ValueError (corrupt metadata, other
    model, other global batch, other backend, nothing left to train); returns the
    checkpoint's meta dict with ``path`` set to the resolved step folder.
    """
    step_dir = resolve(cfg.resume_from)
    meta = read_meta(step_dir)
    meta["path"] = step_dir
    sig = model_signature(cfg)
    if meta["model"].get("fingerprint") != sig["fingerprint"]:
        raise ValueError(_model_mismatch(step_dir, meta, cfg))
    fmt = checkpoint_format(cfg)
    if meta["format"] != fmt:
        raise ValueError(
            f"checkpoint at {step_dir} was written in {meta['format']} format "
            f"(backend {meta['config'].get('backend')}); backend {cfg.backend!r} "
            f"reads {fmt} checkpoints"
        )
    if meta["step"] >= cfg.steps:
        raise ValueError(
            f"checkpoint at {step_dir} is at step {meta['step']}, so steps="
            f"{cfg.steps} leaves nothing to train; set steps > {meta['step']}"
        )
    if world_size is None:
        return meta
    dims = cfg.dims(world_size)
    gb = cfg.global_batch(world_size)
    if meta["global_batch"] != gb:
        raise ValueError(
            f"checkpoint at {step_dir} was trained with global batch "
            f"{meta['global_batch']}, this config has {gb} (micro_batch x "
            f"grad_accum x dp = {cfg.micro_batch} x {cfg.grad_accum} x {dims.dp}); "
            f"keep the global batch to continue the same run"
        )
    per_round = cfg.micro_batch * dims.dp
    if meta["data"]["samples_in_epoch"] % per_round:
        raise ValueError(
            f"checkpoint at {step_dir} stopped {meta['data']['samples_in_epoch']} "
            f"samples into an epoch, not a multiple of micro_batch x dp = "
            f"{per_round}; resume with the checkpoint's micro_batch x dp "
            f"({meta['config'].get('micro_batch')} x {meta['dims'].get('dp')})"
        )
    if fmt == "deepspeed" and (
        meta["world_size"] != world_size
        or meta["dims"] != {"pp": dims.pp, "dp": dims.dp, "tp": dims.tp}
    ):
        raise ValueError(
            f"checkpoint at {step_dir} was written by DeepSpeed on "
            f"{meta['world_size']} ranks {meta['dims']}; DeepSpeed checkpoints "
            f"resume on the same layout only, this run has {world_size} ranks"
        )
    return meta
