"""The nbpar command: train, estimate and bench launch, each with --json.

With ``--json`` exactly one JSON object goes to stdout. Bad arguments exit
with code 2 and one line on stderr, before anything starts.
"""
from __future__ import annotations

import argparse
import json
import sys

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline", "tp", "hybrid")


class UsageError(Exception):
    """Bad arguments: reported as one line, exit code 2."""


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


def build_parser() -> _Parser:
    p = _Parser(prog="nbpar", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train on a fresh pool and report losses, memory, timing")
    t.add_argument("--engines", type=_positive_int, default=None)
    t.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    t.add_argument("--backend", choices=("torch", "deepspeed"), default="torch")
    for dim in ("dp", "tp", "pp"):
        t.add_argument(f"--{dim}", type=_positive_int, default=None)
    t.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default=None)
    t.add_argument("--model", choices=("simple_cnn", "tiny_gpt"), default="tiny_gpt")
    t.add_argument("--dataset", default=None)
    t.add_argument("--steps", type=_positive_int, default=20)
    t.add_argument("--micro-batch", type=_positive_int, default=8)
    t.add_argument("--grad-accum", type=_positive_int, default=1)
    t.add_argument("--lr", type=_positive_float, default=1e-3)
    t.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    t.add_argument("--offload", choices=("none", "optimizer", "params"), default="none")
    t.add_argument("--deepspeed-config", default=None, help="path to a ds_config.json")
    t.add_argument("--seed", type=int, default=0)
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

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    bl = bsub.add_parser("launch", help="pool start-up and cell latency vs raw ipyparallel")
    bl.add_argument("--engines", type=_positive_int, default=2)
    bl.add_argument("--reps", type=_positive_int, default=30)
    bl.add_argument("--json", action="store_true")
    return p


def train_config(args):
    """TrainConfig from CLI args; (cfg, engines), validated before any engine starts."""
    from nbpar.config import TrainConfig

    engines = args.engines
    if engines is None:
        dims = [d for d in (args.dp, args.tp, args.pp) if d]
        engines = 1 if args.strategy == "single" else 2
        if dims:
            engines = 1
            for d in dims:
                engines *= d
    if args.strategy == "single" and engines != 1:
        raise UsageError("--strategy single is the one-process reference: use --engines 1")
    cfg = TrainConfig(model=args.model, dataset=args.dataset, strategy=args.strategy,
                      backend=args.backend, dp=args.dp, tp=args.tp, pp=args.pp,
                      micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                      steps=args.steps, lr=args.lr, precision=args.precision,
                      offload=args.offload, seed=args.seed,
                      deepspeed_config=args.deepspeed_config,
                      checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every or 0,
                      resume_from=args.resume_from,
                      **({"schedule": args.schedule} if args.schedule else {}))
    try:
        cfg.validate(engines)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None
    return cfg, engines


def cmd_train(args) -> dict:
    import nbpar

    cfg, engines = train_config(args)
    with nbpar.Pool(engines) as pool:
        return pool.train(cfg).result()


def cmd_estimate(args) -> dict:
    from nbpar.memory import estimate_memory

    try:
        est = estimate_memory(args.params, args.world_size, args.strategy, dp=args.dp,
                              tp=args.tp, pp=args.pp, optimizer=args.optimizer,
                              precision=args.precision, offload=args.offload)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None
    return est.to_json()


def cmd_bench(args) -> dict:
    from nbpar.bench.launch import bench_launch

    return bench_launch(args.engines, args.reps)


def _human(out: dict) -> str:
    return json.dumps(out, indent=2)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler = {"train": cmd_train, "estimate": cmd_estimate, "bench": cmd_bench}
        out = handler[args.command](args)
    except UsageError as err:
        print(f"nbpar: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out) if args.json else _human(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
