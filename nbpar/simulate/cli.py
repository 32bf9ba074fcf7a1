"""``nbpar simulate``: the subcommand's flags and what it prints (see `nbpar.cli`).

``--model-config JSON`` sets the built-in tiny_gpt's ``gpt`` sizes, e.g.
``{"d_model": 8192, "n_layers": 80, "n_heads": 64}``; other models take it as their
``model_config``. Bad input raises ValueError (one line) before anything is simulated.
"""

from __future__ import annotations

from nbpar.dims import layout_words
from nbpar.strategies import ATTENTIONS, STRATEGIES, resolve_degrees


def add_parser(sub, positive_int, positive_float, add_memory_flags) -> None:
    """Register ``simulate`` on the subparsers ``sub`` of the nbpar command."""
    s = sub.add_parser(
        "simulate",
        help="what each rank of an N-rank run holds and sends, simulated on fake tensors",
    )
    s.add_argument("--model", default="tiny_gpt")
    s.add_argument("--model-config", default=None, help="JSON: tiny_gpt's gpt sizes")
    s.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    s.add_argument("--world-size", type=positive_int, required=True)
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        s.add_argument(f"--{dim}", type=positive_int, default=None)
    s.add_argument("--schedule", choices=("gpipe", "1f1b"), default=None)
    s.add_argument("--attention", choices=ATTENTIONS, default=None, help="with --cp")
    s.add_argument("--precision", choices=("fp32", "bf16", "mixed"), default="fp32")
    s.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    s.add_argument("--micro-batch", type=positive_int, default=1)
    s.add_argument(
        "--grad-accum",
        type=positive_int,
        default=None,
        help="micro-batches per step; default 1, or pp for a pipeline",
    )
    s.add_argument("--seq-len", type=positive_int, default=None)
    s.add_argument(
        "--fsdp-reshard",
        choices=("true", "false"),
        default=None,
        help="hybrid: shard each stage with FSDP2 over dp (ZeRO-3 / ZeRO-2)",
    )
    add_memory_flags(s)  # --activation-checkpointing [full|selective], --sequence-parallel
    s.add_argument(
        "--device-memory",
        type=positive_float,
        default=None,
        metavar="GB",
        help="add fits and margin_bytes against this much device memory",
    )
    s.add_argument(
        "--what-fits",
        action="store_true",
        help="with --device-memory: simulate every strategy on --world-size "
        "ranks and list those whose peak fits",
    )
    s.add_argument("--json", action="store_true")


def config(args):
    """The TrainConfig the flags describe (validated by the simulation itself)."""
    from nbpar.config import GPTConfig, TrainConfig, model_config_fields

    extra = {}
    if args.model_config is not None:
        extra.update(model_config_fields(args.model, args.model_config))
    if args.seq_len is not None:
        extra.setdefault("gpt", GPTConfig()).seq_len = args.seq_len
    try:  # a pipeline keeps pp micro-batches in flight: by default as many as stages
        pp = resolve_degrees(
            args.strategy, args.world_size, args.dp, args.tp, args.pp, args.cp, args.ep
        ).pp
    except ValueError:
        pp = 1  # the simulation refuses these degrees, in the config's words
    for name in ("schedule", "attention", "cp", "ep"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    if args.fsdp_reshard is not None:
        extra["fsdp_reshard"] = args.fsdp_reshard == "true"
    if args.activation_checkpointing is not None:
        extra["activation_checkpointing"] = args.activation_checkpointing
    if args.sequence_parallel:
        extra["sequence_parallel"] = True
    return TrainConfig(
        model=args.model,
        strategy=args.strategy,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        precision=args.precision,
        optimizer=args.optimizer,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum or pp,
        **extra,
    )


def run(args) -> dict:
    """The JSON object ``nbpar simulate`` prints."""
    from nbpar.simulate.fit import what_fits
    from nbpar.simulate.run import simulate

    cfg = config(args)
    if args.what_fits:
        if args.device_memory is None:
            raise ValueError("--what-fits needs --device-memory GB")
        return {
            "world_size": args.world_size,
            "device_memory_gb": args.device_memory,
            "layouts": what_fits(cfg, args.world_size, args.device_memory),
        }
    return dict(simulate(cfg, args.world_size, device_memory_gb=args.device_memory))


def _options(cfg: dict) -> str:
    """ ", sequence parallel, full activation checkpointing" where they are on."""
    from nbpar.checks import checkpointing_kind

    words = ["sequence parallel"] if cfg.get("sequence_parallel") else []
    kind = checkpointing_kind(cfg.get("activation_checkpointing"))
    if kind is not None:
        words.append(f"{kind} activation checkpointing")
    return "".join(f", {w}" for w in words)


def human(out: dict) -> str:
    """What ``nbpar simulate`` prints without ``--json``: a table per simulated role, or
    with ``--what-fits`` one row per layout."""
    from nbpar.estimate import format_bytes_or_dash as size
    from nbpar.measure.records import MEMORY_PARTS
    from nbpar.simulate.roles import describe

    if "layouts" in out:
        lines = [
            f"what fits on {out['world_size']} devices of {out['device_memory_gb']:g} GB",
            f"{'strategy':>8} {'dp':>4} {'tp':>4} {'pp':>4} {'cp':>4} {'ep':>4} {'peak':>10} "
            f"{'fits':>5} {'margin':>10}",
        ]
        for r in out["layouts"]:
            if "error" in r:  # this layout cannot run the model: say why
                lines.append(f"{r['strategy']:>8} refused: {r['error']}")
                continue
            lines.append(
                f"{r['strategy']:>8} {r['dp']:>4} {r['tp']:>4} {r['pp']:>4} {r['cp']:>4} "
                f"{r['ep']:>4} {size(r['peak_bytes']):>10} {'yes' if r['fits'] else 'no':>5} "
                f"{size(r['margin_bytes']):>10}"
            )
        return "\n".join(lines)
    cfg = out["config"]
    head = (
        f"{cfg['strategy']}/{cfg['backend']} {cfg['model']} on {cfg['world_size']} ranks "
        f"({layout_words(cfg)}){_options(cfg)}, simulated in "
        f"{out['seconds']:.1f} s"
    )
    if out.get("fits") is not None:
        head += (
            f"; fits in {size(out['device_memory_bytes'])}: {'yes' if out['fits'] else 'no'}, "
            f"margin {size(out['margin_bytes'])}"
        )
    lines = [
        head,
        f"{'ranks':>12} {'params':>10} {'grads':>10} {'optimizer':>10} {'activations':>11} "
        f"{'peak':>10} {'ring/step':>10}",
    ]
    for r in out["ranks"]:
        parts = " ".join(f"{size(r[k]):>10}" for k in MEMORY_PARTS)
        lines.append(
            f"{describe(r['stands_for']):>12} {parts} "
            f"{size(r.get('activation_bytes')):>11} {size(r['peak_bytes']):>10} "
            f"{size(r.get('comm_bytes')):>10}"
        )
    if out.get("fits") is False:
        from nbpar.simulate.run import why_not

        lines.append(why_not(out["ranks"]))
    return "\n".join(lines)
