"""DeepSpeed ZeRO stages 0-3 (Rajbhandari et al., SC 2020) and ZeRO-Offload
(Ren et al., USENIX ATC 2021) as a StepRunner.

The engine runs on the process group that already exists; on CPU it never
compiles anything: the shm comm op is switched off and the optimizer is a
client torch optimizer built from the config's "optimizer" section.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import warnings

import torch

from nbpar import device
from nbpar.measure.holdings import tensor_bytes
from nbpar.parallel.ds_config import (
    DEEPSPEED_ONLY_PARAMS,
    ds_config_for,
    offload_device,
    optimizer_kind,
)
from nbpar.parallel.runner import StepRunner

# optimizer attributes that hold fp32 master copies (stage 0-3, bf16/fp16 wrappers)
_MASTER_ATTRS = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "fp32_groups_flat_partition",
    "fp32_groups_flat",
    "fp32_groups",
)
# optimizer attributes that keep gradient partitions alive between steps
_GRAD_ATTRS = (
    "averaged_gradients",
    "grad_partitions_flat_buffer",
    "fp32_groups_gradient_flat_partition",
)


def import_deepspeed(backend: str | None = None):
    """Import deepspeed the CPU-safe way: DS_ACCELERATOR=cpu unless ``backend`` (default:
    the process group's, `nbpar.device.current_backend`) drives GPUs; no shm op."""
    device.deepspeed_env(backend or device.current_backend())
    # the first look at its ops probes the linker for libaio ("ld: cannot find -laio"
    # on stderr): harmless noise that reads like a failure in a notebook
    with _quiet_stderr():
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # its per-engine INFO banner would fill every notebook cell's output
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed still calls collectives torch has renamed; one warning per call
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r".*torch\.distributed\.(all_gather_into_tensor|"
        r"reduce_scatter_tensor).*deprecated",
    )
    return deepspeed


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (subprocesses write there, not to sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def client_optimizer(section: dict, params) -> torch.optim.Optimizer:
    """The torch optimizer for a ds_config "optimizer" section (Adam, AdamW, SGD).

    DeepSpeed's "Adam" defaults to ``adam_w_mode`` (decoupled weight decay) with
    weight_decay 0, which torch.optim.AdamW reproduces without compiled ops.
    """
    kind = optimizer_kind(section)
    p = {k: v for k, v in (section.get("params") or {}).items() if k not in DEEPSPEED_ONLY_PARAMS}
    if "betas" in p:
        p["betas"] = tuple(p["betas"])
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    return classes[kind](params, **{"weight_decay": 0.0, **p})


class MeshMPU:
    """DeepSpeed's "mpu" interface read off the ("pp", "dp", "tp") DeviceMesh,
    so the engine reduces over the dp group only when tp > 1."""

    def __init__(self, mesh):
        self.mesh = mesh

    def _group(self, dim):
        return self.mesh[dim].get_group()

    def get_data_parallel_group(self):
        return self._group("dp")

    def get_data_parallel_rank(self):
        return self.mesh["dp"].get_local_rank()

    def get_data_parallel_world_size(self):
        return self.mesh["dp"].size()

    def get_model_parallel_group(self):
        return self._group("tp")

    def get_model_parallel_rank(self):
        return self.mesh["tp"].get_local_rank()

    def get_model_parallel_world_size(self):
        return self.mesh["tp"].size()

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def _tensors(obj):
    """Tensors inside ``obj``: a tensor, or (nested) lists/tuples/dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _as_float(out):
    """A model's output in fp32: a tensor, or each of a tuple's (tiny_moe's logits and
    balance loss)."""
    return tuple(t.float() for t in out) if isinstance(out, tuple) else out.float()


class DeepSpeedRunner(StepRunner):
    """Drives a DeepSpeedEngine: forward, ``engine.backward`` (which divides by the
    accumulation steps and applies the fp16 loss scale), ``engine.step`` (which
    steps the optimizer only at the accumulation boundary)."""

    #: the share of its loss a rank's backward carries: 1, or 1/cp under Ulysses, whose
    #: gradients DeepSpeed sums over the sequence-parallel ranks (`nbpar.parallel.ds_cp`)
    loss_share: float = 1.0

    def __init__(self, engine, loss, config: dict):
        super().__init__(engine, engine.optimizer, loss, device_type=engine.device.type)
        self.engine = engine
        self.config = config
        self.stage = config["zero_optimization"]["stage"]
        self.dtype = (
            torch.float16
            if engine.fp16_enabled()
            else torch.bfloat16
            if engine.bfloat16_enabled()
            else torch.float32
        )

    def train_step(self, micro_batches):
        gas = self.engine.gradient_accumulation_steps()
        if len(micro_batches) != gas:
            raise ValueError(
                f"got {len(micro_batches)} micro-batches, the DeepSpeed engine "
                f"accumulates over gradient_accumulation_steps={gas}"
            )
        losses = []
        for i, (x, y) in enumerate(micro_batches):
            if x.is_floating_point():
                x = x.to(self.dtype)
            loss = self.loss_fn(_as_float(self.engine(x)), y)
            self.engine.backward(loss * self.loss_share if self.loss_share != 1.0 else loss)
            if i == len(micro_batches) - 1:  # DeepSpeed frees its gradients inside step()
                self._boundary_grad_bytes = self._grad_bytes()
            self.engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def set_update_rule(self, cfg, pp_group=None) -> None:
        """Nothing to do: the engine clips and schedules as its config says
        (`nbpar.parallel.ds_config.ds_config_for` wrote the TrainConfig's values there)."""

    def _grad_bytes(self) -> int:
        """``.grad`` of params and masters, plus DeepSpeed's gradient partitions, each
        storage counted whole and once: under ZeRO-1/2 a partition's gradients are views
        of a buffer that holds every parameter it touches whole (`nbpar.ds_partition`)."""
        opt = self.engine.optimizer
        masters = [t for a in _MASTER_ATTRS for t in _tensors(getattr(opt, a, None))]
        partitions = [t for a in _GRAD_ATTRS for t in _tensors(getattr(opt, a, None))]
        return tensor_bytes(
            [p.grad for p in self.parameters()] + [m.grad for m in masters] + partitions
        )

    def parameters(self):
        return list(self.engine.module.parameters())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, as fp32 copies (a collective under ZeRO-3)."""
        deepspeed = import_deepspeed()
        named = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().float().clone() for n, p in named}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, wherever they live (device or host).

        param_bytes: the module's parameters (under ZeRO-3 their ``ds_tensor``
        partitions; gathered copies are transient). optim_bytes: fp32 master
        partitions plus the inner torch optimizer's state. grad_bytes: gradients held
        at the last accumulation boundary, just before step() frees them (partitions,
        buffers, ``.grad`` of params and masters).
        offload_bytes: how much of those DeepSpeed's offload keeps in host memory.
        """
        params = self.parameters()
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        masters = [t for a in _MASTER_ATTRS for t in _tensors(getattr(opt, a, None))]
        state = list(_tensors(list(inner.state.values())))
        state = [t for t in state if t.dim() > 0]
        shards = [getattr(p, "ds_tensor", None) for p in params]
        zero = self.config["zero_optimization"]
        offloaded = []
        if offload_device(zero, "offload_optimizer") != "none":
            offloaded += masters + state
        if offload_device(zero, "offload_param") != "none":
            offloaded += shards
        return {
            "param_bytes": tensor_bytes(params + shards),
            "grad_bytes": max(self._grad_bytes(), getattr(self, "_boundary_grad_bytes", 0)),
            "optim_bytes": tensor_bytes(masters + state),
            "offload_bytes": tensor_bytes(offloaded),
        }

    def close(self) -> None:
        """Destroy the engine and drop every reference to it (idempotent), so
        repeated runs in one engine process do not accumulate models."""
        engine, self.engine = getattr(self, "engine", None), None
        self.model = self.optimizer = None
        if engine is not None:
            release(engine)
        del engine
        gc.collect()


def release(engine) -> None:
    """``engine.destroy()`` plus what it leaves behind in deepspeed 0.19: the
    engine's forward hooks on the user's module, and ZeRO-3's module-level
    ``FWD_MODULE_STACK``, which keeps the root module (and through its hooks
    the whole engine) alive forever, and its global mpu (a pipeline's grid)."""
    module = engine.module
    if hasattr(engine, "destroy"):
        engine.destroy()
    for name in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        handle = getattr(engine, name, None)
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 attributes point back into the optimizer
            p.__dict__.clear()
    # the engine's mpu (a pipeline's grid) stays DeepSpeed's global one, and the next
    # engine in this process would take its model-parallel size from it
    from deepspeed.utils import groups

    groups.mpu = None
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:
        return
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]


def initialize(model, config: dict, mesh=None, mpu=None):
    """``deepspeed.initialize`` on the existing process group with a client optimizer.

    ``config`` is a full ds_config (see `nbpar.parallel.ds_config.ds_config_for`); its
    "optimizer" section becomes the client optimizer. With a ``mesh`` whose dp
    is smaller than the world, the engine gets the dp group through `MeshMPU`; an
    ``mpu`` given (context parallelism's groups) is passed as it is.
    """
    deepspeed = import_deepspeed()
    config = dict(config)
    section = config.pop("optimizer")
    opt = client_optimizer(section, [p for p in model.parameters() if p.requires_grad])
    # (no pipeline stages here: `nbpar.strategies.splits`)
    if mpu is None and mesh is not None and mesh["dp"].size() != mesh.size():
        mpu = MeshMPU(mesh)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=config, mpu=mpu, dist_init_required=False
    )
    return engine


def build_runner(model, cfg, mesh, loss=None) -> DeepSpeedRunner:
    """DeepSpeed ZeRO stage 0 (``ddp``), 1, 2 or 3 over ``mesh["dp"]`` as ``cfg`` asks.

    ``loss`` defaults to ``nbpar.model.models.loss_fn(cfg)``.
    """
    config = ds_config_for(cfg, mesh["dp"].size())
    if loss is None:
        from nbpar.model.models import loss_fn

        loss = loss_fn(cfg)
    engine = initialize(model, config, mesh)
    return DeepSpeedRunner(engine, loss, config)
