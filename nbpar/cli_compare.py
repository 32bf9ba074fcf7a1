"""``nbpar project`` and ``nbpar compare``: their flags, and what they return and print
(see `nbpar.cli`). ``compare --project HW`` puts each finished run's step on that
hardware, estimated by `nbpar.project`, beside what the run measured."""

from __future__ import annotations

import json

from nbpar.cli_args import flagged, positive_float, positive_int
from nbpar.errors import UsageError
from nbpar.strategies import BACKENDS, STRATEGIES


def add_parsers(sub) -> None:
    """Register ``project`` and ``compare`` on the subparsers ``sub`` of the nbpar command."""
    pj = sub.add_parser("project", help="a step on real GPUs, estimated (nbpar.project)")
    pj.add_argument("--list-hardware", action="store_true", help="the machines it knows")
    pj.add_argument("--hardware", default="8xH100-SXM")
    pj.add_argument("--model-params", type=positive_float, default=None)
    pj.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    pj.add_argument("--backend", choices=BACKENDS, default=None)
    pj.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    for flag in ("dp", "tp", "pp", "world-size", "micro-batch", "grad-accum", "seq-len",
                 "layers", "d-model"):  # fmt: skip
        pj.add_argument(f"--{flag}", type=positive_int, default=None)
    for flag in ("tokens-per-step", "flops-per-step", "utilisation"):
        pj.add_argument(f"--{flag}", type=positive_float, default=None)
    pj.add_argument("--json", action="store_true")

    c = sub.add_parser(
        "compare", help="finished runs side by side, from `nbpar train --json` files"
    )
    c.add_argument(
        "results", nargs="+", metavar="RESULT.json", help="what `nbpar train --json` printed"
    )
    c.add_argument(
        "--project",
        default=None,
        metavar="HARDWARE",
        help="add each run's step on this machine, estimated (nbpar project --list-hardware)",
    )
    c.add_argument("--json", action="store_true")


def cmd_project(args) -> dict:
    """The estimate as JSON, with the table people read (assumptions included)."""
    from nbpar.hardware import PRESETS
    from nbpar.project import project

    if args.list_hardware:
        return {"hardware": [{"name": n, "description": h.describe()} for n, h in PRESETS.items()]}
    keys = ("strategy", "backend", "precision", "dp", "tp", "pp", "micro_batch", "grad_accum")
    cfg = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    cfg["gpt"] = {"seq_len": args.seq_len} if args.seq_len else {}
    given = ("world_size", "tokens_per_step", "flops_per_step", "utilisation", "layers", "d_model")
    kwargs = {k: getattr(args, k) for k in given if getattr(args, k) is not None}
    try:
        est = project(cfg, args.hardware, params=args.model_params, **kwargs)
    except (ValueError, TypeError) as err:
        raise UsageError(flagged(err)) from None
    return {**est.to_json(), "table": est.table()}


def cmd_compare(args) -> dict:
    """`nbpar.compare` of result files: {"runs": rows, "warnings", "table"}; with --project
    each row's `nbpar.project` on that hardware under row["projected"], apart."""
    from nbpar.hardware import lookup
    from nbpar.view.compare import compare

    try:  # an unknown name stops here, before any file is read
        hw = lookup(args.project) if args.project is not None else None
    except ValueError as err:
        raise UsageError(f"--project: {err}") from None
    results = [_read_result(path) for path in args.results]
    try:
        cmp = compare(results, project=hw)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    out = {"runs": cmp.table, "warnings": cmp.warnings}
    if cmp.projected is not None:
        out["projected"] = cmp.projected
    return {**out, "table": str(cmp)}


def _read_result(path: str) -> dict:
    """One `nbpar train --json` result from a file; a usage error that names the file."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise UsageError(f"{path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise UsageError(
            f"{path}: not JSON ({err.msg}, line {err.lineno}); expected `nbpar train --json`"
        ) from None
