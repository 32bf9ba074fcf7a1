"""What every strategy builds the same way: the optimizer of a config (`optimizer_spec`,
`make_optimizer`), its autocast dtype (`autocast_dtype`), the device type a model sits on
(`model_device_type`), and the plain one-process runner (`build_single_runner`).

The strategy modules import these from here, not from the package: the package imports
the strategy modules (`nbpar.parallel.build_runner`), so they must not import it back.
"""

from __future__ import annotations


def optimizer_spec(cfg):
    """(torch optimizer class, its keyword arguments) of ``cfg``: Adam, AdamW or SGD with
    ``cfg.lr`` and ``cfg.optimizer_params``; weight decay 0 unless given (DeepSpeed's
    default, so a ds_config's optimizer and this one agree)."""
    import torch

    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if cfg.optimizer not in classes:
        raise ValueError(
            f"optimizer={cfg.optimizer!r} is not supported; choose {', '.join(classes)}"
        )
    kwargs = {"lr": cfg.lr, "weight_decay": 0.0, **(cfg.optimizer_params or {})}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return classes[cfg.optimizer], kwargs


def make_optimizer(params, cfg):
    """The torch optimizer of ``cfg`` (see `optimizer_spec`), the same on every strategy.

    Where the parameters mix DTensors and plain tensors (tensor parallel: the sharded
    layers beside the replicated ones), the optimizer steps one parameter at a time: a
    foreach step (torch's default for GPU tensors) cannot take both kinds in one call."""
    cls, kwargs = optimizer_spec(cfg)
    from torch.distributed.tensor import DTensor

    params = list(params)
    if len({isinstance(p, DTensor) for p in params}) > 1:
        kwargs = {**kwargs, "foreach": False}
    return cls(params, **kwargs)


def autocast_dtype(cfg):
    """The autocast dtype of ``cfg.precision`` (None for fp32)."""
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision]


def model_device_type(model) -> str:
    """The device type the model's first parameter lives on ("cpu" if it has none)."""
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def build_single_runner(model, cfg, mesh=None):
    """Plain one-process training: the base StepRunner."""
    from nbpar.model.models import loss_fn
    from nbpar.parallel.runner import StepRunner

    return StepRunner(
        model,
        make_optimizer(model.parameters(), cfg),
        loss_fn(cfg),
        autocast_dtype=autocast_dtype(cfg),
        device_type=model_device_type(model),
    )
