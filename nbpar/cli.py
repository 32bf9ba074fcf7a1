"""The nbpar command: train, estimate, simulate, project, compare, bench launch; all --json.

With ``--json`` exactly one JSON object goes to stdout. Bad arguments exit
with code 2 and one line on stderr, before anything starts.
"""

from __future__ import annotations

import json
import sys

from nbpar.cli_args import (
    TRAIN_FIELDS,
    Parser,
    add_memory_flags,
    flagged,
    non_negative_float,
    positive_float,
    positive_int,
)
from nbpar.cli_compare import add_parsers as add_compare_parsers
from nbpar.cli_compare import cmd_compare, cmd_project
from nbpar.errors import PoolError, RankError, UsageError
from nbpar.strategies import ATTENTIONS, BACKENDS, SCHEDULES, STRATEGIES, engines_for


def build_parser() -> Parser:
    p = Parser(prog="nbpar", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    t = sub.add_parser("train", help="train on a fresh pool and report losses, memory, timing")
    t.add_argument("--engines", type=positive_int, default=None)
    # training flags default to None: what is not given comes from --deepspeed-config
    # when there is one, else from TrainConfig's defaults
    t.add_argument("--strategy", choices=STRATEGIES, default=None)
    t.add_argument("--backend", choices=BACKENDS, default=None)
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        t.add_argument(f"--{dim}", type=positive_int, default=None)
    t.add_argument("--schedule", choices=SCHEDULES, default=None)
    t.add_argument("--attention", choices=ATTENTIONS, default=None)
    t.add_argument(
        "--model",
        default=None,
        help="simple_cnn, tiny_gpt, tiny_moe, hf:gpt2, hf:llama, hf:mixtral or "
        "package.module:function",
    )
    t.add_argument(
        "--model-config",
        default=None,
        help="JSON: an hf family's config fields, a factory's keyword arguments, "
        "tiny_gpt's gpt sizes (tiny_moe's gpt and moe fields)",
    )
    t.add_argument("--dataset", default=None, help="a built-in name or package.module:function")
    t.add_argument("--loss", default=None, help="package.module:function(output, target)")
    add_memory_flags(t)
    t.add_argument("--steps", type=positive_int, default=None)
    t.add_argument("--micro-batch", type=positive_int, default=None)
    t.add_argument("--grad-accum", type=positive_int, default=None)
    t.add_argument("--lr", type=positive_float, default=None)
    t.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default=None)
    t.add_argument(
        "--grad-clip",
        type=non_negative_float,
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
    t.add_argument("--checkpoint-every", type=positive_int, default=None)
    t.add_argument("--resume-from", default=None, help="a checkpoint dir or one step_* folder")
    t.add_argument("--json", action="store_true")

    e = sub.add_parser("estimate", help="analytic per-rank memory of a model")
    e.add_argument("--params", type=positive_float, required=True)
    e.add_argument("--world-size", type=positive_int, required=True)
    e.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        e.add_argument(f"--{dim}", type=positive_int, default=None)
    e.add_argument(
        "--expert-params",
        type=non_negative_float,
        default=0,
        help="how many of --params are experts' (split over --ep)",
    )
    e.add_argument(
        "--fsdp-reshard",
        choices=("true", "false"),
        default=None,
        help="hybrid or cp: FSDP2 over dp x cp shards every state",
    )
    e.add_argument("--optimizer", default="adam")
    e.add_argument("--precision", choices=("fp32", "mixed", "bf16", "fp16"), default="fp32")
    e.add_argument("--offload", choices=("none", "optimizer", "params"), default="none")
    e.add_argument(
        "--activations",
        default=None,
        metavar="JSON",
        help='add one stage\'s activations: {"batch", "seq_len", "hidden", "layers", '
        '"heads"[, "in_flight"]} (Korthikanti et al. 2022)',
    )
    add_memory_flags(e)
    e.add_argument("--json", action="store_true")

    add_compare_parsers(sub)

    from nbpar.simulate.cli import add_parser as add_simulate_parser

    add_simulate_parser(sub, positive_int, positive_float, add_memory_flags)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=Parser)
    bl = bsub.add_parser("launch", help="pool start-up and cell latency vs raw ipyparallel")
    bl.add_argument("--engines", type=positive_int, default=2)
    bl.add_argument("--reps", type=positive_int, default=30)
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
        from nbpar import device  # one engine per GPU, or 2 on a CPU

        engines = engines_for(cfg.strategy, device.accelerator_count() or 2)
        dims = [d for d in (args.dp, args.tp, args.pp) if d]
        if dims:
            engines = 1
            for d in dims:
                engines *= d
    from nbpar.pool.run import checked_config

    try:  # the one validation and probe of this run, before a pool starts
        cfg = checked_config(cfg, engines)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise UsageError(flagged(err)) from None
    return cfg, engines


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
            cp=args.cp,
            ep=args.ep,
            expert_params=args.expert_params,
            fsdp_reshard=None if args.fsdp_reshard is None else args.fsdp_reshard == "true",
            optimizer=args.optimizer,
            precision=args.precision,
            offload=args.offload,
            activations=_activation_spec(args),
        )
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    return est.to_json()


def _activation_spec(args) -> dict | None:
    """``--activations`` with the recomputation and sequence-parallel flags in it."""
    if args.activations is None:
        for flag in ("activation_checkpointing", "sequence_parallel"):
            if getattr(args, flag) is not None:
                raise UsageError(
                    f"--{flag.replace('_', '-')} changes the activations: give their shape "
                    f'with --activations \'{{"batch", "seq_len", "hidden", "layers", "heads"}}\''
                )
        return None
    try:
        spec = json.loads(args.activations)
    except json.JSONDecodeError as err:
        raise UsageError(f"--activations is not JSON: {err}") from None
    if not isinstance(spec, dict):
        raise UsageError(f"--activations must be a JSON object, got {spec!r}")
    spec.setdefault("sequence_parallel", bool(args.sequence_parallel))
    spec.setdefault("recompute", args.activation_checkpointing or False)
    return spec


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
    """Two lines: the layout, then the per-rank model states (and activations)."""
    from nbpar.dims import layout_words
    from nbpar.estimate import format_bytes

    b = out["per_rank_bytes"]
    n = out["world_size"]
    where = f"{n} rank{'s' * (n != 1)} ({layout_words(out)})"
    acts = f"activations {format_bytes(b['activations'])}, " if "activations" in b else ""
    return (
        f"{out['strategy']} on {where}, {out['optimizer']}, {out['precision']} precision, "
        f"offload {out['offload']}: {out['params'] / 1e9:.3g}B parameters\n"
        f"per rank: params {format_bytes(b['params'])}, grads {format_bytes(b['grads'])}, "
        f"optimizer {format_bytes(b['optim'])}, {acts}total {format_bytes(b['total'])}"
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
