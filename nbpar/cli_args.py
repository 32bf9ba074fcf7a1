"""What the nbpar command's subcommands share: the parser that turns argparse's errors
into `UsageError`, the argument types, and the wording of an error led by its flag."""

from __future__ import annotations

import argparse

from nbpar.errors import UsageError


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def add_memory_flags(parser) -> None:
    """``--activation-checkpointing [full|selective]`` (a bare flag means full) and
    ``--sequence-parallel``: train, estimate and simulate take them alike."""
    from nbpar.checks import CHECKPOINTING

    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=CHECKPOINTING,
        default=None,
        help="recompute in backward: full (each block; the default) or selective "
        "(the attention core only)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="with tensor parallelism: norms and dropout on s/tp tokens per rank",
    )


# CLI flag (argparse dest) -> TrainConfig field, for the flags that set one
TRAIN_FIELDS = (
    "strategy",
    "backend",
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "attention",
    "schedule",
    "model",
    "dataset",
    "loss",
    "activation_checkpointing",
    "sequence_parallel",
    "steps",
    "micro_batch",
    "grad_accum",
    "lr",
    "optimizer",
    "grad_clip",
    "precision",
    "offload",
    "deepspeed_config",
    "seed",
    "checkpoint_dir",
    "checkpoint_every",
    "resume_from",
)


def flagged(err: Exception) -> str:
    """The error's sentence, led by the flag to change when it names one."""
    field, text = getattr(err, "field", None), str(err)
    if field not in TRAIN_FIELDS or text.startswith(field):
        return text
    return f"--{field.replace('_', '-')}: {text}"
