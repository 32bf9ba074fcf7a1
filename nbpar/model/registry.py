"""Where a config's model, data set and loss come from.

A model is one of: a built-in name (``simple_cnn``, ``tiny_gpt``), a Hugging Face
family (``"hf:gpt2"``, ``"hf:llama"``, see `nbpar.model.hf`), a name given to
`register_model`, a ``"package.module:function"`` string, or a picklable callable.
Factories return an ``nn.Module``; ``dataset=`` factories a map-style ``Dataset`` of
``(input, target)``; ``loss=`` is the loss function itself, ``loss(output, target)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from nbpar.checks import about, checkpointing_kind
from nbpar.errors import ConfigError

BUILTIN = ("simple_cnn", "tiny_gpt", "tiny_moe")
#: mixture-of-experts models whose names do not say "moe" (expert parallelism splits them)
MOE_MODELS: tuple[str, ...] = ("hf:mixtral",)


@dataclass(frozen=True)
class Registered:
    """A model registered under a name, with the data set and loss it trains on."""

    factory: object
    dataset: object = None
    loss: object = None


# this process's registrations; a run ships the one it uses to the engines (`entry`)
_registered: dict[str, Registered] = {}


def import_object(spec: str, what: str):
    """The object named by ``"package.module:attribute"``; one-line errors."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what}={spec!r} is not a 'package.module:function' string")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module raising while it loads
        raise ValueError(
            f"{what}={spec!r}: cannot import {module!r} ({type(e).__name__}: {e})"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}={spec!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_callable(spec, what: str):
    """A callable given as itself or as a ``"package.module:function"`` string."""
    obj = import_object(spec, what) if isinstance(spec, str) else spec
    if not callable(obj):
        raise ValueError(f"{what}={spec!r} is not callable")
    return obj


def is_factory_string(value) -> bool:
    return isinstance(value, str) and ":" in value and not value.startswith("hf:")


def register_model(name: str, factory, *, dataset=None, loss=None) -> None:
    """Offer ``factory`` (a callable returning an ``nn.Module``, or its
    ``"package.module:function"``) as model ``name`` in configs, the CLI and the widgets;
    ``dataset``/``loss`` become its defaults."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a model name must be a Python identifier, got {name!r}")
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in model; register under another name")
    resolve_callable(factory, "factory")
    _registered[name] = Registered(factory, dataset, loss)


def registered() -> dict[str, Registered]:
    return dict(_registered)


class ByValue:
    """A callable pickled by value (cloudpickle), with the globals it uses: a function
    defined in a notebook reaches the engines whole (pickle would send only its name)."""

    def __init__(self, fn):
        import cloudpickle

        self.blob, self.name, self._fn = cloudpickle.dumps(fn), display_name(fn), None

    def __getstate__(self):
        return {"blob": self.blob, "name": self.name, "_fn": None}

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            import cloudpickle

            self._fn = cloudpickle.loads(self.blob)
        return self._fn(*args, **kwargs)


def portable(value):
    """``value`` as it can travel to an engine: callables of ``__main__`` by value."""
    if (
        callable(value)
        and not isinstance(value, (str, ByValue))
        and getattr(value, "__module__", None) == "__main__"
    ):
        return ByValue(value)
    return value


def portable_fields(cfg_dict: dict) -> dict:
    """A config dict whose model, dataset and loss reach the engines (`portable`)."""
    return {**cfg_dict, **{k: portable(cfg_dict[k]) for k in ("model", "dataset", "loss")}}


def json_fields(cfg_dict: dict) -> dict:
    """A config dict that ``json.dumps`` writes: callables as their "module:name"."""
    return {
        **cfg_dict,
        **{
            k: display_name(cfg_dict[k])
            for k in ("model", "dataset", "loss")
            if cfg_dict[k] is not None and not isinstance(cfg_dict[k], str)
        },
    }


def entry(model) -> dict[str, Registered]:
    """The registration ``model`` needs on an engine ({} if none): ship it with a run."""
    if isinstance(model, str) and model in _registered:
        r = _registered[model]
        return {model: Registered(portable(r.factory), portable(r.dataset), portable(r.loss))}
    return {}


def adopt(entries: dict[str, Registered]) -> None:
    """Engine side: take the registrations a run brought along."""
    _registered.update(entries)


def model_names() -> list[str]:
    """Every model a config can name: built-ins, Hugging Face families, registered."""
    from nbpar.model.hf import FAMILIES

    return [*BUILTIN, *(f"hf:{f}" for f in FAMILIES), *sorted(_registered)]


def kind(model) -> str:
    """ "builtin", "hf", "registered" or "factory" (a callable or an import string)."""
    if isinstance(model, str):
        if model in BUILTIN:
            return "builtin"
        if model.startswith("hf:"):
            return "hf"
        if model in _registered:
            return "registered"
        if ":" in model:
            return "factory"
        raise ValueError(
            f"model={model!r} is not known; choose one of "
            f"{', '.join(model_names())}, a 'package.module:function' string or "
            f"a callable returning an nn.Module"
        )
    if callable(model):
        return "factory"
    raise ValueError(
        f"model={model!r} must be a name, a 'package.module:function' string or "
        f"a callable returning an nn.Module"
    )


def display_name(model) -> str:
    """A short label for a model spec (a callable's qualified name)."""
    if isinstance(model, str):
        return model
    if isinstance(model, ByValue):
        return model.name
    return f"{getattr(model, '__module__', '?')}:{getattr(model, '__qualname__', repr(model))}"


def check_model_fields(cfg, builtin_datasets: dict) -> None:
    """Cheap checks of model/model_config/dataset/loss (nothing is imported or built
    here beyond resolving names; `nbpar.probe` builds and runs a first batch)."""
    k = kind(cfg.model)
    if cfg.model_config is not None and not isinstance(cfg.model_config, dict):
        raise ConfigError(
            f"model_config must be a dict, got {cfg.model_config!r}", fields=("model_config",)
        )
    if cfg.model_config and k == "builtin":
        raise ConfigError(
            f"model_config applies to hf:* models and factories; size "
            f"{cfg.model!r} with gpt=GPTConfig(...)",
            fields=("model_config", "model"),
        )
    checkpointing_kind(cfg.activation_checkpointing)
    if k == "hf":
        from nbpar.model.hf import family

        family(cfg.model)
    reg = _registered.get(cfg.model) if k == "registered" else None
    ds = cfg.dataset
    if k in ("builtin", "hf") and isinstance(ds, str) and not is_factory_string(ds):
        allowed = builtin_datasets.get(cfg.model, ("pysource",))
        if ds not in allowed:
            raise ConfigError(
                f"dataset={ds!r} does not fit model {cfg.model!r}; "
                f"choose one of {', '.join(allowed)}",
                fields=("dataset", "model"),
            )
    elif ds is not None:
        with about("dataset"):
            resolve_callable(ds, "dataset")
    elif k in ("factory", "registered") and (reg is None or reg.dataset is None):
        raise ConfigError(
            f"model={display_name(cfg.model)} needs dataset= (a function "
            f"returning a map-style Dataset of (input, target), or its "
            f"'package.module:function')",
            fields=("dataset", "model"),
        )
    if cfg.loss is not None:
        with about("loss"):
            resolve_callable(cfg.loss, "loss")
    elif k in ("factory", "registered") and (reg is None or reg.loss is None):
        raise ConfigError(
            f"model={display_name(cfg.model)} needs loss= (a function "
            f"loss(output, target) or its 'package.module:function')",
            fields=("loss", "model"),
        )


def known_shape(cfg) -> tuple[int | None, str | None]:
    """(number of blocks, the config field it comes from) when the config alone says it:
    tiny_gpt's gpt.n_layers, an hf family's layer count; (None, None) for factories."""
    if cfg.model in ("tiny_gpt", "tiny_moe"):
        return cfg.gpt.n_layers, None
    if isinstance(cfg.model, str) and cfg.model.startswith("hf:"):
        from nbpar.model.hf import SHAPE_KEYS, family, shape

        return shape(cfg.model, cfg.model_config)[
            "layers"
        ], f"model_config {SHAPE_KEYS[family(cfg.model)][0]}"
    return None, None


def expert_count(cfg) -> int | None:
    """How many experts each MoE layer of ``cfg``'s model has, when the config alone
    says it (None otherwise)."""
    if cfg.model == "tiny_moe":
        return cfg.moe.n_experts
    if cfg.model in MOE_MODELS:
        from nbpar.model.hf import shape

        return shape(cfg.model, cfg.model_config).get("experts")
    return None
