"""The nbpar command: train, estimate, simulate, project, compare, bench launch; all --json.

With ``--json`` exactly one JSON object goes to stdout. Bad arguments exit
with code 2 and one line on stderr, before anything starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from nbpar.errors import PoolError, RankError, UsageError
from nbpar.strategies import BACKENDS, SCHEDULES, STRATEGIES, engines_for


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


# CLI flag (argparse dest) -> TrainConfig field, for the flags that set one
TRAIN_FIELDS = (
    "strategy",
    "backend",
    "dp",
    "tp",
    "pp",
    "schedule",
    "model",
    "dataset",
    "loss",
    "activation_checkpointing",
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


def build_parser() -> _Parser:
    p = _Parser(prog="nbpar", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train on a fresh pool and report losses, memory, timing")
    t.add_argument("--engines", type=_positive_int, default=None)
    # training flags default to None: what is not given comes from --deepspeed-config
    # when there is one, else from TrainConfig's defaults
    t.add_argument("--strategy", choices=STRATEGIES, default=None)
    t.add_argument("--backend", choices=BACKENDS, default=None)
    for dim in ("dp", "tp", "pp"):
        t.add_argument(f"--{dim}", type=_positive_int, default=None)
    t.add_argument("--schedule", choices=SCHEDULES, default=None)
    t.add_argument(
        "--model",
        default=None,
        help="simple_cnn, tiny_gpt, hf:gpt2, hf:llama or package.module:function",
    )
    t.add_argument(
        "--model-config",
        default=None,
        help="JSON: an hf family's config fields, a factory's keyword arguments, "
        "tiny_gpt's gpt sizes",
    )
    t.add_argument("--dataset", default=None, help="a built-in name or package.module:function")
    t.add_argument("--loss", default=None, help="package.module:function(output, target)")
    t.add_argument("--activation-checkpointing", action="store_true", default=None)
    t.add_argument("--steps", type=_positive_int, default=None)
    t.add_argument("--micro-batch", type=_positive_int, default=None)
    t.add_argument("--grad-accum", type=_positive_int, default=None)
    t.add_argument("--lr", type=_positive_float, default=None)
    t.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default=None)
    t.add_argument(
        "--grad-clip",
        type=_non_negative_float,
        default=None,
        help="clip the global gradient norm; 0 = never (the default)",
    )
    t.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    t.add_argument("--offload", choices=("none", "optimizer", "params"), default=None)
    t.add_argument(
        "--deepspeed-config",
        default=None,
        help="path to a ds_config.json; flags not given are taken from it",
    )
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--checkpoint-dir", default=None)
    t.add_argument("--checkpoint-every", type=_positive_int, default=None)
    t.add_argument("--resume-from", default=None, help="a checkpoint dir or one step_* folder")
    t.add_argument("--json", action="store_true")

    e = sub.add_parser("estimate", help="analytic per-rank memory of a model")
    e.add_argument("--params", type=_positive_float, required=True)
    e.add_argument("--world-size", type=_positive_int, required=True)
    e.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    for dim in ("dp", "tp", "pp"):
        e.add_argument(f"--{dim}", type=_positive_int, default=None)
    e.add_argument("--optimizer", default="adam")
    e.add_argument("--precision", choices=("fp32", "mixed", "bf16", "fp16"), default="fp32")
    e.add_argument("--offload", choices=("none", "optimizer", "params"), default="none")
    e.add_argument("--json", action="store_true")

    pj = sub.add_parser("project", help="a step on real GPUs, estimated (nbpar.project)")
    pj.add_argument("--list-hardware", action="store_true", help="the machines it knows")
    pj.add_argument("--hardware", default="8xH100-SXM")
    pj.add_argument("--model-params", type=_positive_float, default=None)
    pj.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    pj.add_argument("--backend", choices=BACKENDS, default=None)
    pj.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    for flag in ("dp", "tp", "pp", "world-size", "micro-batch", "grad-accum", "seq-len",
                 "layers", "d-model"):  # fmt: skip
        pj.add_argument(f"--{flag}", type=_positive_int, default=None)
    for flag in ("tokens-per-step", "flops-per-step", "utilisation"):
        pj.add_argument(f"--{flag}", type=_positive_float, default=None)
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

    from nbpar.simulate.cli import add_parser as add_simulate_parser

    add_simulate_parser(sub, _positive_int, _positive_float)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    bl = bsub.add_parser("launch", help="pool start-up and cell latency vs raw ipyparallel")
    bl.add_argument("--engines", type=_positive_int, default=2)
    bl.add_argument("--reps", type=_positive_int, default=30)
    bl.add_argument("--json", action="store_true")
    return p


def train_config(args):
    """TrainConfig from CLI args; (cfg, engines), validated before any engine starts.

    Only the flags given reach the TrainConfig, so a --deepspeed-config decides the rest.
    """
    from nbpar.config import TrainConfig, model_config_fields

    given = {name: getattr(args, name) for name in TRAIN_FIELDS if getattr(args, name) is not None}
    try:
        if args.model_config is not None:
            given.update(model_config_fields(given.get("model", "tiny_gpt"), args.model_config))
        cfg = TrainConfig(**given)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    engines = args.engines
    if engines is None:
        engines = engines_for(cfg.strategy, 2)
        dims = [d for d in (args.dp, args.tp, args.pp) if d]
        if dims:
            engines = 1
            for d in dims:
                engines *= d
    from nbpar.pool.run import checked_config

    try:  # the one validation and probe of this run, before a pool starts
        cfg = checked_config(cfg, engines)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise UsageError(_flagged(err)) from None
    return cfg, engines


def _flagged(err: Exception) -> str:
    """The error's sentence, led by the flag to change when it names one."""
    field, text = getattr(err, "field", None), str(err)
    if field not in TRAIN_FIELDS or text.startswith(field):
        return text
    return f"--{field.replace('_', '-')}: {text}"


def cmd_train(args) -> dict:
    import nbpar
    from nbpar.pool.run import launch

    cfg, engines = train_config(args)
    with nbpar.Pool(engines) as pool:
        run = launch(pool, cfg)
        if not args.json:
            _follow(run, cfg.steps)
        return run.result()


def _follow(run, steps: int) -> None:
    """A progress bar on stderr while the run trains (stdout keeps the result)."""
    import time

    from tqdm import tqdm

    with tqdm(
        total=steps,
        desc=f"{run.cfg.strategy}/{run.cfg.backend}",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        while not run.done():
            history = run.history
            done = len({rec["step"] for rec in history})
            if done > bar.n:
                bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", refresh=False)
                bar.update(done - bar.n)
            time.sleep(0.2)
        bar.update(steps - bar.n)


def cmd_estimate(args) -> dict:
    from nbpar.estimate import estimate_memory

    try:
        est = estimate_memory(
            args.params,
            args.world_size,
            args.strategy,
            dp=args.dp,
            tp=args.tp,
            pp=args.pp,
            optimizer=args.optimizer,
            precision=args.precision,
            offload=args.offload,
        )
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    return est.to_json()


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
        raise UsageError(_flagged(err)) from None
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
        cmp = compare(results)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    out = {"runs": cmp.table, "warnings": cmp.warnings}
    if hw is not None:
        out["projected"] = _project_rows(cmp.table, results, hw)
    return {**out, "table": _compare_table(str(cmp), out)}


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


def model_params(config: dict) -> int:
    """The parameter count of a result's model, built on the meta device (no weights)."""
    import torch

    from nbpar.config import TrainConfig
    from nbpar.model.models import build_model

    with torch.device("meta"):
        model = build_model(TrainConfig.from_dict(config))
    return sum(p.numel() for p in model.parameters())


def _project_rows(rows: list[dict], results: list[dict], hw) -> dict:
    """Set each row's ``projected`` to its run's `nbpar.project` on ``hw`` (None, with
    ``projected_error`` the line why, where it cannot be projected); the hardware and
    the assumptions of them all, each once."""
    from nbpar.project import project

    notes: list[str] = []
    for row, res in zip(rows, results):
        try:
            est = project(res, hw, params=model_params(res["config"]))
        except (ValueError, TypeError) as err:
            row["projected"], row["projected_error"] = None, str(err)
            continue
        row["projected"] = {**est.to_json(), "hardware": hw.name}
        notes += est.assumptions
    return {"hardware": hw.name, "description": hw.describe(), "assumptions": notes}


def _compare_table(measured: str, out: dict) -> str:
    """The measured table; with a projection its estimate columns after a bar, the rows
    it could not project, and its assumptions once."""
    proj = out.get("projected")
    if proj is None:
        return measured
    from nbpar.project import describe_assumptions

    lines = measured.splitlines()
    table, warnings = lines[: 1 + len(out["runs"])], lines[1 + len(out["runs"]) :]
    cells = [(f"est. step on {proj['hardware']} (s)", "est. exposed")]
    cells += [("-", "-") if r["projected"] is None else _estimate_cells(r) for r in out["runs"]]
    widths = [max(len(c[i]) for c in cells) for i in (0, 1)]
    width = max(map(len, table))
    rows = [
        f"{m.ljust(width)}  |  {a.rjust(widths[0])}  {b.rjust(widths[1])}"
        for m, (a, b) in zip(table, cells)
    ]
    rows += warnings
    rows += [
        f"est.: {r['label']}: {r['projected_error']}" for r in out["runs"] if r["projected"] is None
    ]
    rows.append(f"est. = estimated by nbpar.project, not measured, on {proj['description']}")
    if proj["assumptions"]:
        rows += ["assumptions:", describe_assumptions(proj["assumptions"])]
    return "\n".join(rows)


def _estimate_cells(row: dict) -> tuple[str, str]:
    """A row's estimated step (seconds) and exposed communication share, as printed."""
    p = row["projected"]
    return f"{p['step_s']:.3g}", f"{p['exposed_share']:.1%}"


def cmd_simulate(args) -> dict:
    from nbpar.simulate.cli import run

    try:
        return run(args)
    except ValueError as err:
        raise UsageError(str(err)) from None


def cmd_bench(args) -> dict:
    from nbpar.bench.launch import bench_launch

    return bench_launch(args.engines, args.reps)


def _human(command: str, out: dict) -> str:
    """What a subcommand prints for people (without ``--json``)."""
    if command == "simulate":
        from nbpar.simulate.cli import human

        return human(out)
    if command == "estimate":
        return _human_estimate(out)
    if command == "compare":
        return out["table"]
    if command == "project":
        return out.get("table") or "\n".join(h["description"] for h in out["hardware"])
    if command == "train":
        return _human_train(out)
    return json.dumps(out, indent=2)


def _human_estimate(out: dict) -> str:
    """Two lines: the layout, then the per-rank model states."""
    from nbpar.estimate import format_bytes

    b = out["per_rank_bytes"]
    n = out["world_size"]
    where = f"{n} rank{'s' * (n != 1)} (dp {out['dp']} x tp {out['tp']} x pp {out['pp']})"
    return (
        f"{out['strategy']} on {where}, {out['optimizer']}, {out['precision']} precision, "
        f"offload {out['offload']}: {out['params'] / 1e9:.3g}B parameters\n"
        f"per rank: params {format_bytes(b['params'])}, grads {format_bytes(b['grads'])}, "
        f"optimizer {format_bytes(b['optim'])}, total {format_bytes(b['total'])}"
    )


RING_NOTE = (
    "ring/step: bytes a rank sends under the ring algorithm, counted at the c10d call "
    "(one metered step), not bytes measured on the wire"
)


def _human_train(out: dict) -> str:
    """A table for people: per-rank memory, step time, communication, final loss."""
    from nbpar.estimate import format_bytes_or_dash as size
    from nbpar.measure.records import MEMORY_PARTS

    cfg = out["config"]
    comm = f"communication in flight {out['comm_fraction']:.0%} of the metered step"
    if out.get("comm_blocked_fraction") is not None:  # every normal step, measured
        comm = (
            f"blocked on communication {out['comm_blocked_fraction']:.0%} of a normal step, {comm}"
        )
    if out.get("exposed_comm_fraction") is not None:  # the metered step's split
        comm += f" (exposed {out['exposed_comm_fraction']:.0%}"
        if out.get("comm_wait_fraction") is not None:
            comm += f", waiting for a slower rank {out['comm_wait_fraction']:.0%}"
        comm += ")"
    lines = [
        f"{cfg['strategy']}/{cfg['backend']} {cfg['model']}: {len(out['losses'])} steps, "
        f"final loss {out['losses'][-1]:.4f}, step {out['step_time_s'] * 1e3:.1f} ms, {comm}"
        + ("" if out.get("bubble_fraction") is None else f", bubble {out['bubble_fraction']:.0%}"),
        f"{'rank':>4} {'params':>10} {'grads':>10} {'optimizer':>10} {'activations':>11} "
        f"{'peak':>10} {'process':>10} {'ring/step':>10}",
    ]
    for r in out["ranks"]:
        parts = " ".join(f"{size(r[k]):>10}" for k in MEMORY_PARTS)
        lines.append(
            f"{r['rank']:>4} {parts} {size(r.get('activation_bytes')):>11} "
            f"{size(r['peak_bytes']):>10} {size(r.get('process_peak_bytes')):>10} "
            f"{size(r.get('comm_bytes')):>10}"
        )
    if out.get("timing_note"):  # whether the times above can be trusted on this machine
        lines.append(out["timing_note"])
    lines.append(RING_NOTE)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler = {
            "train": cmd_train,
            "estimate": cmd_estimate,
            "bench": cmd_bench,
            "simulate": cmd_simulate,
            "project": cmd_project,
            "compare": cmd_compare,
        }
        out = handler[args.command](args)
    except UsageError as err:
        print(f"nbpar: error: {err}", file=sys.stderr)
        return 2
    except (RankError, PoolError) as err:  # the run started and failed: one line, not ours
        print(f"nbpar: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(out) if args.json else _human(args.command, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
