"""GPU check: tokens/s and MFU of a GPT (TinyGPT at d_model 1024, 8 layers, seq 1024) in bf16.

Runs the single-GPU forms of nbpar's strategies in this process (world size 1,
nccl: single, ddp, zero1, zero2, zero3 by default) through the same
``run_training`` loop the engines use, and prints one JSON object.

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B):
    flops_per_token = 6 * N + 12 * L * s * d
    MFU = tokens_per_s * flops_per_token / peak_bf16_flops
6N counts the forward (2N) and backward (4N) matmul FLOPs per token over all N
parameters; 12 L s d is the attention score and value products (Q K^T and
A V, forward + backward) of L layers at sequence length s and width d. The
peak comes from nbpar.device.peak_flops_hint (H100 SXM / H200 989, A100 312
TFLOP/s dense bf16) or --peak-tflops.

Each run also sets nbpar's tracked memory beside the CUDA allocator's at the metered
step (``allocator``: tracked peak / allocator peak, model states / allocated), the
cross-check of the measured memory figures on a GPU.

Two ranks on one GPU: nccl refuses two ranks on the same device ("Duplicate
GPU detected"), and nbpar's gloo engines compute on CPU, so that form is
reported as skipped, not measured. ``--dry-run`` runs 2 steps of a tiny
config on the CPU (gloo, mfu null) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

DEFAULT_STRATEGIES = "single,ddp,zero1,zero2,zero3"
SHARED_GPU = (
    "nccl refuses two ranks on one GPU (duplicate GPU); nbpar's gloo engines "
    "compute on CPU, so 2 engines sharing a GPU is not a measurable form"
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, each run at world size 1 (default {DEFAULT_STRATEGIES})",
    )
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per strategy")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    p.add_argument("--precision", choices=("bf16", "fp32", "fp16"), default="bf16")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak bf16 TFLOP/s of the GPU when its name is not in the table",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="2 steps of a tiny config on the CPU (mfu null): checks the script",
    )
    args = p.parse_args(argv)
    if args.dry_run:
        args.d_model, args.layers, args.heads, args.seq_len = 32, 2, 4, 32
        args.micro_batch, args.steps, args.warmup = 4, 2, 0
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def flops_per_token(params: int, layers: int, seq_len: int, d_model: int) -> int:
    """6N + 12 L s d: training FLOPs per token (see the module docstring)."""
    return 6 * params + 12 * layers * seq_len * d_model


def _init_world_of_one(backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def allocator_check(history: list[dict]) -> dict:
    """nbpar's tracked memory beside the CUDA caching allocator's, at the metered step.

    ``tracked_peak_bytes`` is `nbpar.measure.memtrack`'s peak of live storages during the
    metered step; ``device_peak_bytes`` the allocator's peak during that step (the loop
    resets it at every step's start, as the CPU figures are per step) and
    ``device_allocated_bytes`` what it holds after the step, beside the model states
    nbpar counts then. The allocator rounds each block up (512 B) and holds cuBLAS/NCCL
    workspaces nbpar does not see, so its figures are expected a little higher; a ratio
    far from 1 is what to look into. On a CPU the device figures are None.
    """
    from nbpar.measure.records import model_state_bytes

    metered = [r for r in history if r.get("tracked_peak_bytes") is not None]
    if not metered:
        return {"error": "no metered step in the history (run at least 3 steps)"}
    r = metered[0]
    states = model_state_bytes(r)
    peak, held = r.get("device_peak_bytes"), r.get("device_allocated_bytes")
    return {
        "step": r["step"],
        "tracked_peak_bytes": r["tracked_peak_bytes"],
        "device_peak_bytes": peak,
        "peak_ratio": r["tracked_peak_bytes"] / peak if peak else None,
        "states_bytes": states,
        "device_allocated_bytes": held,
        "states_ratio": states / held if held else None,
    }


def measure(strategy: str, args, fpt: int, peak: float | None) -> dict:
    """Train ``args.steps`` steps of one strategy; tokens/s over the steps after warm-up."""
    from nbpar.config import GPTConfig, TrainConfig
    from nbpar.train.loop import run_training

    cfg = TrainConfig(
        model="tiny_gpt",
        strategy=strategy,
        micro_batch=args.micro_batch,
        steps=args.steps,
        precision=args.precision,
        gpt=GPTConfig(
            d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len
        ),
    )
    try:
        res = run_training(cfg)
    except Exception as err:  # one strategy failing must not hide the others
        return {"strategy": strategy, "error": f"{type(err).__name__}: {err}"}
    timed = res["history"][args.warmup :]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    tokens_per_s = args.micro_batch * args.seq_len / step_s
    achieved = tokens_per_s * fpt
    return {
        "strategy": strategy,
        "step_time_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "peak_bytes": res["peak_bytes"],
        "allocator": allocator_check(res["history"]),
        "losses": res["losses"],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from nbpar import device
    from nbpar.config import GPTConfig, TrainConfig
    from nbpar.model.models import build_model

    problem = None if args.dry_run else device.cpu_torch_on_a_gpu_machine()
    if problem:  # not a CPU result that reads as the GPU's
        return {"device": None, "error": problem, "runs": []}
    gpus = 0 if args.dry_run else device.accelerator_count()
    backend = device.default_backend(gpus)
    name = device.gpu_name() if gpus else "cpu"
    peak = None
    if gpus:
        peak = args.peak_tflops * 1e12 if args.peak_tflops else device.peak_flops_hint(name)
    gpt = GPTConfig(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len
    )
    params = sum(
        p.numel() for p in build_model(TrainConfig(model="tiny_gpt", gpt=gpt)).parameters()
    )
    fpt = flops_per_token(params, args.layers, args.seq_len, args.d_model)
    _init_world_of_one(backend)
    runs = [measure(s.strip(), args, fpt, peak) for s in args.strategies.split(",") if s.strip()]
    torch.distributed.destroy_process_group()
    return {
        "device": name,
        "gpus": gpus,
        "backend": backend,
        "precision": args.precision,
        "peak_tflops": peak / 1e12 if peak else None,
        "dry_run": args.dry_run,
        "model": {
            "d_model": args.d_model,
            "n_layers": args.layers,
            "n_heads": args.heads,
            "seq_len": args.seq_len,
            "params": params,
        },
        "micro_batch": args.micro_batch,
        "flops_per_token": fpt,
        "runs": runs,
        "shared_gpu": {"skipped": SHARED_GPU},
        "note": None if peak or not gpus else "unknown GPU: pass --peak-tflops for MFU",
    }


if __name__ == "__main__":
    out = main()
    print(json.dumps(out))
    sys.exit(1 if all("error" in r for r in out["runs"]) else 0)
