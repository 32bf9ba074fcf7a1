"""The one place that knows about accelerators: cpu vs cuda, gloo vs nccl.

Everything else asks this module which device an engine uses and which
torch.distributed backend fits it, so the same notebook runs on a laptop CPU
(gloo, N engine processes) and on GPUs (one engine per GPU, nccl).
"""

from __future__ import annotations

import gc
import glob
import os
import sys

from nbpar.hardware import PEAK_BF16_TFLOPS

BACKENDS = ("gloo", "nccl")


def accelerator_count() -> int:
    """Number of visible GPUs on this host (0 without a CUDA build or driver).

    Answers without importing torch (1-2 s) when the host has no NVIDIA driver,
    so starting a CPU pool does not wait for it.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if (
        sys.platform.startswith("linux")
        and not os.path.isdir("/proc/driver/nvidia")
        and not glob.glob("/dev/nvidia[0-9]*")
    ):
        return 0  # Linux without an NVIDIA driver or device
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvidia_present() -> bool:
    """Whether this host has an NVIDIA GPU device or driver tool, whatever torch says:
    ``NBPAR_NVIDIA_DEV`` (default /dev/nvidia0, as scripts/install_torch.sh reads it),
    another /dev/nvidiaN, or nvidia-smi on the PATH."""
    import shutil

    dev = os.environ.get("NBPAR_NVIDIA_DEV", "/dev/nvidia0")
    return (
        os.path.exists(dev)
        or bool(glob.glob("/dev/nvidia[0-9]*"))
        or bool(shutil.which("nvidia-smi"))
    )


def cpu_torch_on_a_gpu_machine() -> str | None:
    """One sentence when this host has an NVIDIA GPU and the installed torch was built
    without CUDA (every run would quietly fall back to gloo on the CPU), else None."""
    if not nvidia_present():
        return None
    import torch

    if torch.version.cuda is not None:
        return None
    return (
        f"this machine has an NVIDIA GPU but torch {torch.__version__} was built without "
        f"CUDA: reinstall torch from the default index (pip install --force-reinstall "
        f"torch=={torch.__version__.split('+')[0]}) or see scripts/install_torch.sh"
    )


def default_backend(n_gpus: int | None = None) -> str:
    """nccl when GPUs are present, gloo otherwise."""
    if n_gpus is None:
        n_gpus = accelerator_count()
    return "nccl" if n_gpus > 0 else "gloo"


def pool_plan(
    n: int | None, backend: str | None, n_gpus: int, local: bool = True
) -> tuple[int, str, str | None]:
    """(engines, backend, one-line note or None) for a pool asked for ``n`` engines.

    ``n`` None: one engine per GPU, else 2. With fewer GPUs than engines and no backend
    given the pool runs CPU engines on gloo, because engines cannot share one GPU under
    NCCL and gloo on the CPU is what every notebook is written for; an explicit "nccl"
    with too few GPUs (local launcher) is a ValueError before anything starts.
    """
    if n is None:
        n = n_gpus if n_gpus > 0 and backend != "gloo" else 2
    note = None
    if backend is None:
        backend = "nccl" if 0 < n <= n_gpus or (n_gpus > 0 and not local) else "gloo"
        if backend == "gloo" and n_gpus > 0:
            note = (
                f"{n} engines on {n_gpus} GPU(s): CPU engines on gloo "
                f"(pass backend='nccl' with at most {n_gpus} engines to use the GPUs)"
            )
    elif backend == "nccl" and local and n > n_gpus:
        raise ValueError(
            f"{n} GPU engines asked for but this machine has {n_gpus} "
            f"GPU(s): use Pool({n_gpus}) or backend='gloo'"
        )
    return n, backend, note


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for a pool on ``backend``: on GPUs the
    default group carries gloo for CPU tensors beside nccl for GPU ones, so a CPU
    tensor in a ``%%dist`` cell or a clock exchange works there too."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def backend_of(group_backend: str) -> str:
    """The pool backend ("gloo", "nccl") of what ``dist.get_backend()`` says: nccl
    when any device of the group uses it (`process_group_backend`), else as given."""
    parts = [p.rsplit(":", 1)[-1] for p in group_backend.split(",")]
    return "nccl" if "nccl" in parts else group_backend


def current_backend() -> str:
    """The pool backend of this process's default group, or this host's default
    (`default_backend`) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return backend_of(dist.get_backend())
    return default_backend()


def device_type(backend: str) -> str:
    """The torch device type that a process-group backend drives."""
    return "cuda" if backend == "nccl" else "cpu"


def bind(local_rank: int, backend: str) -> str:
    """Bind this process to its device and return the device string.

    On GPUs, engine ``local_rank`` takes GPU ``local_rank`` of its host; on CPU
    every engine uses ``cpu``.
    """
    import torch

    if backend != "nccl":
        return "cpu"
    index = gpu_index(local_rank, torch.cuda.device_count(), os.environ)
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def gpu_index(local_rank: int, visible: int, env) -> int:
    """The GPU an engine of ``local_rank`` takes among the ``visible`` ones: its local
    rank; or the one GPU a scheduler bound to this task (Slurm's ``--gpus-per-task=1``
    leaves each task one device in ``CUDA_VISIBLE_DEVICES``, so every local rank sees
    device 0)."""
    if local_rank < visible:
        return local_rank
    bound = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible == 1 and len(bound) == 1:
        return 0
    raise RuntimeError(
        f"engine with local rank {local_rank} has no GPU: this host shows {visible}"
        + (f" (CUDA_VISIBLE_DEVICES={','.join(bound)})" if bound else "")
    )


def total_memory(backend: str) -> int | None:
    """Bytes of memory of this host's first GPU for a pool on ``backend`` (None on a
    CPU pool, or where this process sees no GPU: the engines' hosts may differ)."""
    import torch

    if backend != "nccl" or not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return None
    return torch.cuda.get_device_properties(0).total_memory


def current_device(backend: str):
    """The torch.device this process computes on."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def memory_stats(backend: str) -> dict:
    """Allocated and peak bytes on this process's device (GPU only, else {})."""
    import torch

    if backend != "nccl" or not torch.cuda.is_initialized():
        return {}
    stats = {
        "device_allocated_bytes": torch.cuda.memory_allocated(),
        "device_peak_bytes": torch.cuda.max_memory_allocated(),
    }
    try:  # NVML (pynvml); absent on some installs
        stats["device_util_pct"] = torch.cuda.utilization()
    except Exception:
        pass
    return stats


def reset_peak(backend: str, *, collect: bool = True) -> None:
    """Start the allocator's peak (``device_peak_bytes``) afresh (GPU only). With
    ``collect``, garbage in reference cycles (a previous run's tensors) is freed
    first, so the new peak does not start from memory nobody holds."""
    import torch

    if backend == "nccl" and torch.cuda.is_initialized():
        if collect:
            gc.collect()
        torch.cuda.reset_peak_memory_stats()


def gpu_name() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def synchronize(backend: str) -> None:
    """Wait for queued device work so timers measure it (no-op on CPU)."""
    import torch

    if backend == "nccl":
        torch.cuda.synchronize()


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident set size of process ``pid`` (default: this one), None if unreadable."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:
        return None


def bytes_written() -> int | None:
    """Bytes this process has written, as the kernel counts them (``wchar`` of
    /proc/self/io; None where unreadable). gloo sends over TCP sockets with write calls,
    so its change around a collective is what this rank put on the wire (plus gloo's
    message headers, a few hundred bytes, and anything else written meanwhile). NCCL
    over NVLink or InfiniBand writes no socket: there it says nothing."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int:
    """Highest RSS this process reached (getrusage: KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def half_precision_support(backend: str) -> dict[str, bool]:
    """Which half-precision dtypes this host computes natively: {"bf16": .., "fp16": ..}.

    On CPU, oneDNN's own probes: fp16 needs AVX512-FP16 or AMX-FP16 (recent Intel
    server CPUs; DeepSpeed's CPU accelerator refuses fp16 without them), bf16 runs
    everywhere (emulated where AVX512-BF16/AMX are absent). On GPUs, what CUDA reports.
    """
    import torch

    if backend == "nccl":
        return {"bf16": torch.cuda.is_bf16_supported(), "fp16": True}
    try:
        fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        fp16 = False
    return {"bf16": True, "fp16": fp16}


def cpu_model() -> str:
    """The CPU's model name ("unknown CPU" where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def check_precision(precision: str, backend: str | None = None) -> None:
    """Raise ValueError (reason and way out, one line) when this host cannot run
    ``precision`` ("fp32", "bf16", "fp16") on ``backend`` (default: the local one)."""
    if precision == "fp32":
        return
    backend = backend or default_backend()
    if half_precision_support(backend)[precision]:
        return
    if backend == "nccl":
        raise ValueError(
            f"precision {precision!r} is not supported by this GPU "
            f"({gpu_name()}): use 'fp16' or 'fp32'"
        )
    other = "bf16" if precision == "fp16" else "fp32"
    raise ValueError(
        f"precision {precision!r} on this CPU ({cpu_model()}) needs AVX512-FP16 "
        f"or AMX-FP16, which it lacks: use precision {other!r}"
    )


def deepspeed_env(backend: str) -> None:
    """Make DeepSpeed run on CPU (no compiler) unless ``backend`` drives GPUs: a gloo
    pool on a GPU machine keeps its models on the CPU."""
    if device_type(backend) == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def rng_state(backend: str) -> dict:
    """This process's random states: the CPU generator's and, on a GPU in use, its
    device generator's (what a checkpoint keeps so a resumed run draws the same)."""
    import torch

    state = {"cpu": torch.get_rng_state()}
    if backend == "nccl" and torch.cuda.is_initialized():
        state["device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state, backend: str) -> None:
    """Restore what `rng_state` returned; a plain tensor is the CPU state alone (the
    checkpoints written before device states were kept). A device state is restored
    only on a GPU pool."""
    import torch

    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if backend == "nccl" and "device" in state:
        torch.cuda.set_rng_state(state["device"])


def peak_flops_hint(name: str | None = None) -> float | None:
    """Peak bf16 FLOP/s of GPU ``name`` (default: this host's GPU 0); None if unknown.
    The datasheet figures are `nbpar.hardware`'s, matched most specific name first."""
    name = gpu_name() if name is None else name
    for key, tflops in PEAK_BF16_TFLOPS:
        if name and key.lower() in name.lower():
            return tflops * 1e12
    return None


def flash_attention_ops(q, k, v):
    """torch's flash attention kernel for ``q``'s device as a (forward, backward) pair of
    one block of attention with its log-sum-exp (the interface of
    `nbpar.parallel.attention_block`): CPU's ``_scaled_dot_product_flash_attention_for_cpu``;
    CUDA's ``_scaled_dot_product_flash_attention`` where it takes these tensors (fp16 or
    bf16, Ampere or newer, head dim a multiple of 8; `cuda_flash_pair`). None elsewhere."""
    import torch

    aten = torch.ops.aten
    if q.device.type == "cpu":
        fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        return (
            lambda q, k, v, causal, scale: fwd(q, k, v, 0.0, causal, scale=scale),
            lambda g, q, k, v, o, lse, causal, scale: bwd(
                g, q, k, v, o, lse, 0.0, causal, scale=scale
            ),
        )
    if q.device.type != "cuda" or q.shape[-1] % 8:
        return None
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
    if not torch.backends.cuda.can_use_flash_attention(params):
        return None
    return cuda_flash_pair(
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
    )


def cuda_flash_pair(fwd, bwd):
    """CUDA's flash ops ``fwd``, ``bwd`` as (out, lse) forward and backward, no dropout.
    Dense inputs: no cumulative sequence lengths (None), the longest sequences are the
    tensors' own. The dropout generator state backward asks for is never read without
    dropout; it is made as torch's meta kernel makes the forward's (ROCm: int64 scalars)."""
    import torch

    def forward(q, k, v, causal, scale):
        out, lse, *_ = fwd(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse  # (b, h, sq, d), (b, h, sq) fp32

    def backward(g, q, k, v, out, lse, causal, scale):
        if torch.version.hip:
            seed = offset = torch.empty((), dtype=torch.long, device=q.device)
        else:
            seed = torch.empty(2, dtype=torch.uint64, device=q.device)
            offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dense = (None, None, q.shape[2], k.shape[2])  # cum_seq_q, cum_seq_k, max_q, max_k
        lse = lse.contiguous()  # the kernel reads it dense
        grads = bwd(g, q, k, v, out, lse, *dense, 0.0, causal, seed, offset, scale=scale)
        return grads[:3]

    return forward, backward
