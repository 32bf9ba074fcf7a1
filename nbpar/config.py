"""Validated training configuration: what to train, how to split it, how long.

`TrainConfig` is the one object the widgets, the CLI and `pool.train` build; it
is checked once, before any engine does work, so a bad combination fails with
one sentence instead of a hang inside a collective. Degrees become a
`ParallelDims` (torchtitan-style topology, in `nbpar.dims`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from nbpar.checks import about, choice, positive_int
from nbpar.dims import ParallelDims
from nbpar.errors import ConfigError
from nbpar.strategies import (
    ATTENTIONS,
    BACKENDS,
    DEFAULT_ATTENTION,
    DEFAULT_SCHEDULE,
    OFFLOADS,
    PIPELINED,
    SCHEDULES,
    STRATEGIES,
    check_combination,
    check_model_degrees,
    reshard_after_forward,
    resolve_degrees,
)

DATASETS = {
    "simple_cnn": ("cifar10", "digits"),
    "tiny_gpt": ("pysource",),
    "tiny_moe": ("pysource",),
}
PRECISIONS = ("fp32", "bf16", "fp16")
#: models whose vocabulary gpt.vocab_size sets for byte-level text
BYTE_MODELS = ("tiny_gpt", "tiny_moe", "hf:gpt2", "hf:llama", "hf:mixtral")
OPTIMIZERS = ("adam", "adamw", "sgd")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}", fields=(name,))


@dataclass(kw_only=True)
class GPTConfig:
    """Sizes of the tiny decoder-only transformer (GPT-2 layout, pre-norm)."""

    vocab_size: int = 256
    """number of token ids; 256 = one token per byte"""
    seq_len: int = 32
    """context length in tokens (also the number of position embeddings)"""
    d_model: int = 32
    """hidden width d"""
    n_heads: int = 4
    """attention heads; must divide d_model (and be divisible by the tp degree)"""
    n_layers: int = 2
    """number of transformer blocks"""
    ffn_mult: int = 4
    """feed-forward width = ffn_mult * d_model"""
    dropout: float = 0.0
    """dropout probability in attention and feed-forward (0 keeps runs comparable)"""

    def validate(self) -> GPTConfig:
        """Raise ConfigError naming the first bad size (``gpt.<field>``); returns self."""
        for f in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "ffn_mult"):
            positive_int(f"gpt.{f}", getattr(self, f))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"gpt.n_heads={self.n_heads} must divide gpt.d_model={self.d_model}",
                fields=("gpt.n_heads", "gpt.d_model"),
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"gpt.dropout must be in [0, 1), got {self.dropout!r}", fields=("gpt.dropout",)
            )
        return self


@dataclass(kw_only=True)
class MoEConfig:
    """The experts of tiny_moe (its other sizes are ``gpt``'s): every block's feed-forward
    is a top-k router over ``n_experts`` expert FFNs of gpt.ffn_mult * d_model width."""

    n_experts: int = 4
    """expert FFNs per block (expert parallelism holds n_experts / ep of them per rank)"""
    top_k: int = 2
    """experts each token is sent to: 1 (Switch, weighted by its router probability) or
    more (GShard / Mixtral, weights renormalised over the k chosen)"""
    aux_loss_coef: float = 0.01
    """weight of the load-balancing loss (computed per sequence, see `nbpar.model.moe`);
    0 = none"""

    def validate(self) -> MoEConfig:
        """Raise ConfigError naming the first bad field (``moe.<field>``); returns self."""
        positive_int("moe.n_experts", self.n_experts)
        positive_int("moe.top_k", self.top_k)
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"moe.top_k={self.top_k} must be at most moe.n_experts={self.n_experts}",
                fields=("moe.top_k", "moe.n_experts"),
            )
        coef = self.aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ConfigError(
                f"moe.aux_loss_coef must be a number >= 0, got {coef!r}",
                fields=("moe.aux_loss_coef",),
            )
        return self


@dataclass(kw_only=True)
class TrainConfig:
    """One training experiment: model, data, strategy, degrees and step budget."""

    model: str | Callable = "tiny_gpt"
    """"simple_cnn" (CIFAR-10 shaped images), "tiny_gpt" (byte-level language model),
    "tiny_moe" (tiny_gpt with mixture-of-experts feed-forwards, sized by ``moe``),
    "hf:gpt2" / "hf:llama" / "hf:mixtral" (transformers, random init from
    ``model_config``), a name given to `nbpar.register_model`, a "package.module:function"
    string or a picklable callable returning an nn.Module (called with ``model_config`` as
    keyword arguments)"""
    model_config: dict | None = None
    """a Hugging Face family's config fields (e.g. {"hidden_size": 256}), or a factory's
    keyword arguments"""
    dataset: str | Callable | None = None
    """None = the model's default: "cifar10" for simple_cnn, "pysource" for tiny_gpt and
    hf:*; simple_cnn also takes "digits" (scikit-learn's bundled 8x8 digits); for a factory
    model a callable or "package.module:function" returning a map-style Dataset of
    (input, target)"""
    loss: str | Callable | None = None
    """loss(output, target) -> scalar, or its "package.module:function"; None = the
    model's own (cross entropy for the built-ins and hf:*)"""
    activation_checkpointing: bool | str = False
    """recompute activations in backward instead of keeping them (tiny_gpt, hf:*): "full"
    (or True) keeps only each block's input and recomputes the block; "selective" keeps
    the linear layers' outputs and recomputes only the attention core (Korthikanti et al.
    2022); False keeps everything"""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (Korthikanti et al. 2022) with tensor parallelism
    (tp > 1; tiny_gpt, hf:llama): the norms and dropout run on s/tp tokens per rank, the
    all-reduces become all-gathers and reduce-scatters"""
    data_dir: str | None = None
    """where CIFAR-10 format files live; generated there (synthetic) when absent"""
    strategy: str = "ddp"
    """single ddp zero1 zero2 zero3 pipeline tp hybrid cp ep"""
    backend: str = "torch"
    """"torch" (native DDP/ZeroRedundancyOptimizer/FSDP2/pipelining/DTensor) or "deepspeed\""""
    dp: int | None = None
    """data-parallel degree; None = the strategy's default (all engines for ddp/zero*)"""
    tp: int | None = None
    """tensor-parallel degree; None = all engines for tp, else 1"""
    pp: int | None = None
    """pipeline stages; None = all engines for pipeline, else 1"""
    cp: int | None = None
    """context-parallel degree (ranks that split every sequence); None = all engines
    for cp (less dp), else 1"""
    ep: int | None = None
    """expert-parallel degree (data-parallel ranks that share out the experts; divides
    dp); None = every data-parallel rank for ep, else 1"""
    attention: str = DEFAULT_ATTENTION
    """how context parallelism attends over the split sequence: "ring" (K/V blocks passed
    around the ranks) or "ulysses" (all-to-all to a split of the heads)"""
    schedule: str = DEFAULT_SCHEDULE
    """pipeline schedule gpipe | 1f1b | interleaved | zbv | dualpipev; only
    pipeline/hybrid may change it"""
    micro_batch: int = 8
    """samples per micro-batch on one data-parallel rank"""
    grad_accum: int = 1
    """micro-batches per optimizer step (for pipelines: micro-batches in flight)"""
    steps: int = 20
    """optimizer steps to run"""
    lr: float = 1e-3
    """learning rate"""
    optimizer: str = "adam"
    """"adam" (torch.optim.Adam), "adamw" (torch.optim.AdamW, decoupled weight decay) or
    "sgd" (torch.optim.SGD)"""
    optimizer_params: dict | None = None
    """more keyword arguments of the optimizer, e.g. {"betas": [0.9, 0.95], "eps": 1e-8,
    "weight_decay": 0.1}; weight decay defaults to 0 for every kind (DeepSpeed's default)"""
    grad_clip: float = 0.0
    """clip the global gradient norm to this before each optimizer step; 0 = never"""
    lr_schedule: dict | None = None
    """a learning-rate schedule in DeepSpeed's "scheduler" format, e.g. {"type":
    "WarmupLR", "params": {"warmup_num_steps": 10}}, run alike on every backend
    (see `nbpar.model.lr_schedule`); None = constant lr"""
    precision: str = "fp32"
    """fp32 | bf16 (autocast) | fp16 (deepspeed only: it brings the loss scaler)"""
    offload: str = "none"
    """none | optimizer | params: DeepSpeed ZeRO-Offload of optimizer state / parameters"""
    seed: int = 0
    """seeds model init, data order and the synthetic data set"""
    fsdp_reshard: bool | None = None
    """FSDP2 reshard_after_forward; None = False for zero2, True for zero3"""
    deepspeed_config: dict | str | None = None
    """a ds_config dict or the path of a ds_config.json; it is read when the TrainConfig is
    made, and every field not given explicitly is taken from it (stage -> strategy,
    micro-batch, accumulation, precision, offload, optimizer, lr, clipping, scheduler;
    backend becomes "deepspeed"); its "auto" values are filled from the TrainConfig.
    A field given explicitly that disagrees with the config is an error."""
    gpt: GPTConfig = field(default_factory=GPTConfig)
    """sizes of tiny_gpt (and of tiny_moe's transformer)"""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """the experts of tiny_moe"""
    checkpoint_dir: str | None = None
    """where checkpoints are written"""
    checkpoint_every: int = 0
    """save every N steps; 0 = never"""
    checkpoint_keep: int = 2
    """how many of the newest checkpoints to keep in checkpoint_dir"""
    resume_from: str | None = None
    """a checkpoint folder (step_*) or a checkpoint_dir (its latest) to continue from"""

    # ---- derived values -------------------------------------------------
    def dataset_name(self) -> str:
        """The dataset actually used (resolves the model's default); a factory's label."""
        from nbpar.model.registry import display_name

        if self.dataset is not None:
            return display_name(self.dataset)
        return DATASETS.get(self.model, ("pysource",))[0]

    def fsdp_reshard_after_forward(self) -> bool | None:
        """FSDP2's reshard_after_forward for this run, None where it uses no FSDP2
        (`nbpar.strategies.reshard_after_forward`, the one rule)."""
        return reshard_after_forward(self.strategy, self.fsdp_reshard)

    def dims(self, world_size: int) -> ParallelDims:
        """The validated (pp, dp, cp, tp) topology and ep for ``world_size`` engines
        (`nbpar.strategies.resolve_degrees`, with the splits this backend runs)."""
        return resolve_degrees(
            self.strategy,
            world_size,
            self.dp,
            self.tp,
            self.pp,
            self.cp,
            self.ep,
            backend=self.backend,
        )

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step: micro_batch x grad_accum x dp."""
        return self.micro_batch * self.grad_accum * self.dims(world_size).dp

    # ---- validation -----------------------------------------------------
    def validate(
        self, world_size: int | None = None, *, pg_backend: str | None = None
    ) -> TrainConfig:
        """The checked config this one runs as, for ``world_size`` engines (None: any)
        of a pool on ``pg_backend`` ("gloo", "nccl"; None: this host's default), which
        decides whether the precision is judged for the CPU or the GPU.

        Pure: ``self`` is never changed. The result is a copy when a ds_config's
        ``train_batch_size`` decides the micro-batch or accumulation on this many
        engines, else ``self``. Raises `ConfigError` naming the first bad field."""
        for name, allowed in (
            ("strategy", STRATEGIES),
            ("backend", BACKENDS),
            ("schedule", SCHEDULES),
            ("attention", ATTENTIONS),
            ("precision", PRECISIONS),
            ("optimizer", OPTIMIZERS),
            ("offload", OFFLOADS),
        ):
            choice(name, getattr(self, name), allowed)
        from nbpar.model.registry import check_model_fields

        with about("model"):
            check_model_fields(self, DATASETS)
        for name in ("micro_batch", "grad_accum", "steps", "checkpoint_keep"):
            positive_int(name, getattr(self, name))
        positive_int("checkpoint_every", self.checkpoint_every, minimum=0)
        _positive("lr", self.lr)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(
                "checkpoint_every > 0 needs checkpoint_dir", fields=("checkpoint_dir",)
            )
        self.gpt.validate()
        self.moe.validate()
        if self.model in BYTE_MODELS and self.gpt.vocab_size < 256:
            raise ConfigError(
                f"gpt.vocab_size={self.gpt.vocab_size} is too small for byte-level "
                f"text; it must be >= 256",
                fields=("gpt.vocab_size",),
            )
        self._validate_optimizer()
        check_combination(self)
        check_model_degrees(self, world_size)
        checked = self
        if self.deepspeed_config is not None:
            checked = self._validate_ds_config(world_size)
        if self.precision != "fp32":  # what this host's CPU or GPU can compute
            from nbpar import device

            with about("precision"):
                device.check_precision(self.precision, pg_backend)
        if self.resume_from is not None:  # missing/corrupt/other model: before engines work
            from nbpar.checkpoint_meta import check_resume

            with about("resume_from"):
                check_resume(checked, world_size)
        return checked

    def _validate_optimizer(self) -> None:
        from nbpar.parallel.ds_config import OPTIMIZER_PARAMS

        params = self.optimizer_params or {}
        if not isinstance(params, dict):
            raise ConfigError(
                f"optimizer_params must be a dict, got {params!r}", fields=("optimizer_params",)
            )
        bad = sorted(set(params) - set(OPTIMIZER_PARAMS[self.optimizer]))
        if bad:
            raise ConfigError(
                f"optimizer_params {', '.join(bad)} do not apply to optimizer "
                f"{self.optimizer!r}; it takes "
                f"{', '.join(OPTIMIZER_PARAMS[self.optimizer])}",
                fields=("optimizer_params", "optimizer"),
            )
        if (
            isinstance(self.grad_clip, bool)
            or not isinstance(self.grad_clip, (int, float))
            or self.grad_clip < 0
        ):
            raise ConfigError(
                f"grad_clip must be a number >= 0, got {self.grad_clip!r}", fields=("grad_clip",)
            )
        if self.lr_schedule is not None:
            from nbpar.model.lr_schedule import resolve

            with about("lr_schedule"):
                resolve(self.lr_schedule, self.lr, self.steps)

    def _validate_ds_config(self, world_size: int | None) -> TrainConfig:
        """Check ``deepspeed_config`` against this config; on ``world_size`` engines, the
        copy with the micro-batch and accumulation its ``train_batch_size`` decides."""
        if not isinstance(self.deepspeed_config, dict):
            raise ConfigError(
                f"deepspeed_config must be a dict or a JSON file path, "
                f"got {self.deepspeed_config!r}",
                fields=("deepspeed_config",),
            )
        from nbpar.parallel.ds_config import (
            check_pipeline_stage,
            ds_config_for,
            fit_train_batch_size,
        )

        with about("deepspeed_config"):
            if self.strategy in PIPELINED:
                check_pipeline_stage(self.deepspeed_config)
            if world_size is None:
                return self
            dp = self.dims(world_size).dp
            sizes = {"micro_batch": self.micro_batch, "grad_accum": self.grad_accum}
            fitted = fit_train_batch_size(self.deepspeed_config, dp, sizes, self._explicit)
            checked = copy.copy(self) if fitted else self
            for name, value in fitted.items():
                setattr(checked, name, value)
            # a ds_config that disagrees with this config (micro batch, stage,
            # precision, ...) is refused here, before any engine starts
            ds_config_for(checked, dp)
        return checked

    def _adopt_deepspeed_config(self) -> None:
        """Read ``deepspeed_config`` (a path becomes the dict it holds) and take from it
        every field that was not given explicitly."""
        if self.deepspeed_config is None:
            return
        from nbpar.parallel.ds_config import load_ds_config, train_settings

        self.deepspeed_config = load_ds_config(self.deepspeed_config)
        settings = train_settings(self.deepspeed_config)
        settings.setdefault("backend", "deepspeed")
        if self.strategy in PIPELINED or "strategy" in self._explicit:
            settings.pop("strategy", None)  # a pipeline's stage is its ZeRO 0/1 only
        for name, value in settings.items():
            if name not in self._explicit:
                setattr(self, name, copy.deepcopy(value))

    # ---- serialisation --------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able dict (nested ``gpt`` and ``moe`` as dicts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """Inverse of `to_dict`; unknown keys raise ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s) {', '.join(unknown)}", fields=unknown)
        d = dict(d)
        nested = {name: _nested(c, name, d.pop(name, None)) for name, c in NESTED.items()}
        return cls(**d, **{k: v for k, v in nested.items() if v is not None})


#: TrainConfig's nested configs: field -> class
NESTED = {"gpt": GPTConfig, "moe": MoEConfig}


def _nested(cls, name: str, value):
    """A nested config from its dict (unknown keys raise ConfigError naming them)."""
    if not isinstance(value, dict):
        return value
    bad = sorted(set(value) - {f.name for f in fields(cls)})
    if bad:
        raise ConfigError(
            f"unknown {cls.__name__} field(s) {', '.join(bad)}",
            fields=tuple(f"{name}.{b}" for b in bad),
        )
    return cls(**value)


def model_config_fields(model: str, text: str) -> dict:
    """TrainConfig fields from a ``--model-config`` JSON object: tiny_gpt's ``gpt`` sizes
    (tiny_moe's ``gpt`` and ``moe`` fields, by name), else the model's ``model_config``."""
    import json

    try:
        sizes = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--model-config is not JSON: {err}") from None
    if not isinstance(sizes, dict):
        raise ValueError(f"--model-config must be a JSON object, got {sizes!r}")
    if model not in ("tiny_gpt", "tiny_moe"):
        return {"model_config": sizes}
    moe_keys = {f.name for f in fields(MoEConfig)} if model == "tiny_moe" else set()
    try:
        out = {"gpt": GPTConfig(**{k: v for k, v in sizes.items() if k not in moe_keys})}
        if moe_keys:
            out["moe"] = MoEConfig(**{k: v for k, v in sizes.items() if k in moe_keys})
    except TypeError as err:
        raise ValueError(f"--model-config: {err}") from None
    return out


def _explicit_fields(cls):
    """Wrap the dataclass ``__init__`` so a TrainConfig remembers which fields were
    given (``_explicit``): a ds_config decides only the others."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs):
        init(self, **kwargs)
        self._explicit = frozenset(kwargs)
        self._adopt_deepspeed_config()

    cls.__init__ = __init__
    return cls


TrainConfig = _explicit_fields(TrainConfig)
