"""GPU check, the first command on a GPU: what only a device can show, in one JSON object.

In order, each a part of the output: ``detect`` (torch's CUDA and NCCL builds, nbpar's
device count, backend, GPU name and peak FLOPs hint); ``join`` (the engine's join path,
`nbpar.pool.worker`: a rendezvous store, the process group, an all_reduce of a device
tensor, the memory read, leave, then all of it again, as a re-run pool cell does);
``runs`` (the single-GPU forms of nbpar's strategies through the same ``run_training``
loop the engines use, world size 1: single, ddp, zero1-3, pipeline, tp and hybrid at
degree 1, with tokens/s, MFU and the allocator cross-check; ``losses`` says whether they
agree); ``meter`` (the step meter's clock against a known chain of matmuls and an
all_reduce: a compute time far below the synchronized wall time means GPU work is timed
at its launch). With ``--out`` the object is also written there, with the date and the
commit; on a GPU it goes to benchmarks/results/gpu/ by default.

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
reported as skipped, not measured. ``--dry-run`` runs all of it with a tiny config on the
CPU (gloo, mfu null): everything but the device calls, to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_STRATEGIES = "single,ddp,zero1,zero2,zero3,pipeline,tp,hybrid"
#: what a strategy needs beyond the shared config to run on one device
ONE_DEVICE = {"hybrid": {"dp": 1, "tp": 1, "pp": 1}}
#: largest |loss - single's loss| over the steps that still counts as the same training
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}
FP16_SKIPPED = (
    "fp16 runs with DeepSpeed's loss scaler, on its data-parallel strategies only "
    "(ddp, zero1-3); run this one in bf16"
)
#: a compute time under this share of the synchronized wall time: timed at launch
LAUNCH_SHARE = 0.1
GPU_RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
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
        help="everything with a tiny config on the CPU (mfu null): checks the script",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the JSON here (default on a GPU: benchmarks/results/gpu/)",
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
    from nbpar.strategies import DATA_PARALLEL
    from nbpar.train.loop import run_training

    backend = "torch"
    if args.precision == "fp16":  # it needs DeepSpeed's loss scaler
        if strategy not in DATA_PARALLEL:
            return {"strategy": strategy, "skipped": FP16_SKIPPED}
        backend = "deepspeed"
    cfg = TrainConfig(
        backend=backend,
        model="tiny_gpt",
        strategy=strategy,
        micro_batch=args.micro_batch,
        steps=args.steps,
        precision=args.precision,
        gpt=GPTConfig(
            d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len
        ),
        **ONE_DEVICE.get(strategy, {}),
    )
    try:
        res = run_training(cfg)
    except Exception as err:  # one strategy failing must not hide the others
        return {"strategy": strategy, "error": f"{type(err).__name__}: {err}"}
    timed = res["history"][args.warmup :]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    tokens_per_s = args.micro_batch * args.seq_len / step_s
    achieved = tokens_per_s * fpt
    out = {
        "strategy": strategy,
        "step_time_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "peak_bytes": res["peak_bytes"],
        "allocator": allocator_check(res["history"]),
        "losses": res["losses"],
    }
    if res.get("bubble_fraction") is not None:  # the spans' share of the step: near 1 on
        out["spans_share_of_step"] = 1 - res["bubble_fraction"]  # one stage, unless at launch
    return out


def losses_agree(runs: list[dict], precision: str) -> dict:
    """Each run's largest |loss - the reference's| over the steps (the single-process run,
    else the first that trained), against the tolerance."""
    trained = [r for r in runs if "losses" in r]
    ref = next((r for r in trained if r["strategy"] == "single"), trained[0] if trained else None)
    if ref is None:
        return {"error": "no run trained", "ok": False}
    ref = ref["losses"]
    diffs = {
        r["strategy"]: max(abs(a - b) for a, b in zip(r["losses"], ref))
        for r in runs
        if "losses" in r
    }
    tol = LOSS_TOLERANCE[precision]
    return {"max_abs_diff": diffs, "tolerance": tol, "ok": all(d <= tol for d in diffs.values())}


def detect() -> dict:
    """What torch was built with and what nbpar's device module finds."""
    import torch

    from nbpar import device

    gpus = device.accelerator_count()
    nccl = None
    if gpus and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    name = device.gpu_name() if gpus else None
    return {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "nccl": nccl,
        "gpus": gpus,
        "default_backend": device.default_backend(gpus),
        "gpu_name": name,
        "peak_tflops_hint": (device.peak_flops_hint(name) or 0) / 1e12 or None,
        "cpu_torch_on_a_gpu_machine": device.cpu_torch_on_a_gpu_machine(),
    }


def join_check(backend: str, timeout_s: float = 60.0) -> dict:
    """The engine's join path twice over (join, then join again, as a re-run pool cell
    does): store, process group, an all_reduce of a device tensor, the memory read."""
    import torch
    import torch.distributed as dist

    from nbpar import device
    from nbpar.pool import worker

    attempts = []
    for attempt in ("join", "join again"):
        t0 = time.perf_counter()
        addr, port = worker.open_store("127.0.0.1", 0, timeout_s)
        facts = worker.join(0, 1, addr, port, backend, timeout_s, env={})
        x = torch.full((1024,), 2.0, device=device.current_device(backend))
        dist.all_reduce(x)
        attempts.append(
            {
                "attempt": attempt,
                "seconds": time.perf_counter() - t0,
                "device": str(facts["device"]),
                "group_backend": dist.get_backend(),
                "all_reduce_ok": bool(x.eq(2.0).all()),
                "memory": device.memory_stats(backend),
            }
        )
    return {"attempts": attempts, "ok": all(a["all_reduce_ok"] for a in attempts)}


def meter_check(backend: str, n: int, matmuls: int = 8) -> dict:
    """The step meter's clock (`step_clock`) against a known amount of device work: a chain
    of ``matmuls`` n x n matmuls, then an all_reduce of the result, timed by the meter and
    by the host around a synchronize."""
    import torch
    import torch.distributed as dist

    from nbpar import device
    from nbpar.measure.clocks import step_clock
    from nbpar.measure.comm import CommMeter

    dev = device.current_device(backend)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    (a @ b).sum().item()  # warm: kernels chosen, memory pooled
    device.synchronize(backend)
    t0 = time.perf_counter()
    with CommMeter(marks=step_clock(backend)) as meter:
        c = a
        for _ in range(matmuls):
            c = torch.tanh(c @ b)  # tanh keeps the values finite along the chain
        dist.all_reduce(c)
    device.synchronize(backend)
    wall = time.perf_counter() - t0
    compute = meter.compute_s()
    return {
        "matmuls": matmuls,
        "n": n,
        "flops": 2 * n**3 * matmuls,
        "wall_s": wall,
        "meter_compute_s": compute,
        "meter_comm_s": meter.comm_s(),
        "meter_window_s": meter.window_s(),
        "compute_share_of_wall": compute / wall if wall > 0 else None,
        "timed_at_launch": compute < LAUNCH_SHARE * wall,
    }


def write(out: dict, path: Path) -> Path:
    """``out`` with the date and the commit, as JSON at ``path`` (a folder: a new file)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import commit

    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(), **out}
    if path.suffix != ".json":
        path.mkdir(parents=True, exist_ok=True)
        path = path / f"gpu_check-{out['date'].replace(':', '')}.json"
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)

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
    found = detect()
    joined = join_check(backend)  # the strategies then run in the group it joined
    runs = [measure(s.strip(), args, fpt, peak) for s in args.strategies.split(",") if s.strip()]
    meter = meter_check(backend, n=4096 if gpus else 256)
    from nbpar.pool import worker

    worker.leave()  # the group and its store
    out = {
        "device": name,
        "detect": found,
        "join": joined,
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
        "losses": losses_agree(runs, args.precision),
        "meter": meter,
        "shared_gpu": {"skipped": SHARED_GPU},
        "note": None if peak or not gpus else "unknown GPU: pass --peak-tflops for MFU",
    }
    path = args.out or (GPU_RESULTS if gpus else None)
    if path is not None:
        out["written_to"] = str(write(out, path))
    return out


def failed(out: dict) -> bool:
    """Whether a part of the check failed (any run, the join, the losses or the meter)."""
    if out.get("error"):
        return True
    return (
        any("error" in r for r in out["runs"])
        or not out["join"]["ok"]
        or not out["losses"].get("ok")
        or out["meter"]["timed_at_launch"]
    )


if __name__ == "__main__":
    out = main()
    print(json.dumps(out))
    sys.exit(1 if failed(out) else 0)
