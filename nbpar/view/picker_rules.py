"""The StrategyPicker's words and reasoning: every problem of a choice at once, in the
words of the picker's labels, and advice that is valid on the pool at hand.

The rules themselves are `TrainConfig.validate` (nbpar.config, the one place for them);
this module only asks them. `validate` raises a `ConfigError` for the first problem it
meets, naming the fields it is about, so `problems` asks again with one of those fields
set to a neutral value (offload none, precision fp32, schedule gpipe, ...) until the
choice passes, and so finds the next one.
"""

from __future__ import annotations

import itertools
import re

from nbpar import config as C
from nbpar.errors import ConfigError
from nbpar.strategies import DEGREES, WORLD_DEGREES

#: field -> the label of its control in the picker
LABELS = {
    "model": "model",
    "strategy": "strategy",
    "backend": "backend",
    "schedule": "schedule",
    "dp": "dp",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
    "ep": "ep",
    "attention": "attention",
    "activation_checkpointing": "checkpointing",
    "sequence_parallel": "sequence parallel",
    "precision": "precision",
    "offload": "offload",
    "micro_batch": "micro-batch",
    "grad_accum": "grad accum",
    "steps": "steps",
}
MODEL_WORDS = {
    "gpt.n_heads": "the model's attention heads",
    "gpt.d_model": "the model's width",
    "gpt.n_layers": "the model's layers",
    "gpt.vocab_size": "the model's vocabulary",
    "gpt.seq_len": "the model's context length",
}
#: whole numbers the picker's boxes take: field -> largest value
COUNTS = {"micro_batch": 4096, "grad_accum": 4096, "steps": 10**6}
#: which field to set neutral first when a message names several; strategy never
NEUTRAL_ORDER = (
    "offload",
    "precision",
    "schedule",
    "attention",
    "sequence_parallel",
    "activation_checkpointing",
    "model",
    "micro_batch",
    "grad_accum",
    "steps",
    "dp",
    "backend",
)
NEUTRAL = {
    "offload": "none",
    "precision": "fp32",
    "schedule": "gpipe",
    "attention": "ring",
    "sequence_parallel": False,
    "activation_checkpointing": False,
    "model": "tiny_gpt",
    "backend": "torch",
    "micro_batch": 8,
    "grad_accum": 1,
    "steps": 20,
}
_ASSIGN_RE = re.compile(
    r"\b("
    + "|".join(list(MODEL_WORDS) + list(LABELS)).replace(".", r"\.")
    + r")=('?)([^\s',;)]+)\2"
)


def in_words(message: str) -> str:
    """A TrainConfig message in the picker's words: ``grad_accum=1`` -> ``grad accum 1``,
    ``'gpipe'`` -> ``gpipe``, ``dp*tp*pp`` -> ``dp × tp × pp``."""
    words = {**LABELS, **MODEL_WORDS}
    text = re.sub(r"(?<!\w)'([^'\s]*)'", r"\1", message)  # 'gpipe' -> gpipe; DeepSpeed's stays
    text = _ASSIGN_RE.sub(lambda m: f"{words[m[1]]} {m[3]}", text)
    for name, said in MODEL_WORDS.items():
        text = text.replace(name, said)
    text = re.sub(r"\b(micro_batch|grad_accum)\b", lambda m: LABELS[m[1]], text)
    text = re.sub(r"(?<=\w)\s*\*\s*(?=\w)", " × ", text)
    text = text.replace("must be a positive integer", "must be a whole number of at least 1")
    return re.sub(r"\bdp x tp x pp( x cp)?\b", lambda m: m[0].replace(" x ", " × "), text)


def parse_count(field: str, text: str) -> tuple[int | None, str | None]:
    """(value, None) for a whole number typed in a box, else (None, why in words).
    Zero and negative numbers pass through: `TrainConfig.validate` refuses them."""
    label, top = LABELS[field], COUNTS[field]
    text = str(text).strip()
    if not text:
        return None, f"{label} is empty: type a whole number"
    if not re.fullmatch(r"[+-]?\d+", text):
        return None, f"{label} must be a whole number, not {text}"
    value = int(text)
    if value > top:
        return None, f"{label} {value} is more than this picker runs (at most {top})"
    return value, None


def degree_tuples(n: int):
    """(dp, tp, pp, cp) with dp × tp × pp × cp = n: combined dimensions first, pipelines
    first, then data parallelism, context parallelism last."""
    found = [
        (dp, tp, pp, n // (dp * tp * pp))
        for dp, tp, pp in itertools.product(range(1, n + 1), repeat=3)
        if n % (dp * tp * pp) == 0
    ]
    return sorted(found, key=lambda d: (-sum(x > 1 for x in d), -d[2], -d[0], d[3]))


def hybrid_layout(values: dict, world: int) -> dict | None:
    """A hybrid layout that `validate` accepts on ``world`` engines for this model, or None;
    of those, one that keeps most of the degrees the user chose."""
    chosen = {k: values[k] for k in WORLD_DEGREES if values.get(k)}
    layouts = sorted(  # stable: the usual order among those that keep as many
        degree_tuples(world),
        key=lambda t: -sum(chosen.get(k) == v for k, v in zip(WORLD_DEGREES, t)),
    )
    base = {
        **values,
        **{k: NEUTRAL[k] for k in ("offload", "precision", "backend")},
        "strategy": "hybrid",
        "schedule": "gpipe",
    }
    for layout in layouts:
        degrees = dict(zip(WORLD_DEGREES, layout))
        try:
            C.TrainConfig.from_dict({**base, **degrees}).validate(world)
        except ConfigError:
            continue
        return degrees
    return None


def _advice(values: dict, world: int) -> str:
    layout = hybrid_layout(values, world)
    if layout is None:
        return f" (no hybrid layout of this model fits {world} engines)"
    said = " × ".join(f"{k} {v}" for k, v in layout.items() if k != "cp" or v > 1)
    return f" (on these {world} engines e.g. {said})"


def _neutralise(values: dict, named: set, world: int) -> bool:
    """Set the first field a message names (in NEUTRAL_ORDER) to a neutral value, so the
    next `validate` can find the next problem; False when nothing changes."""
    for field in NEUTRAL_ORDER:
        if field == "dp" and named & set(DEGREES):
            hybrid = values.get("strategy") == "hybrid"
            layout = (hybrid_layout(values, world) if hybrid else None) or dict.fromkeys(
                WORLD_DEGREES
            )
            layout = {**layout, "ep": None}
            if any(values.get(k) != v for k, v in layout.items()):
                values.update(layout)
                return True
        elif field in named and values.get(field) != NEUTRAL[field]:
            values[field] = NEUTRAL[field]
            return True
    return False


def problems(values: dict, world: int) -> list[str]:
    """Every reason, in the labels' words, why ``values`` (TrainConfig fields) cannot run
    on ``world`` engines; [] when it can."""
    values, found = dict(values), []
    for _ in range(len(NEUTRAL_ORDER) + 2):
        try:
            C.TrainConfig.from_dict(values).validate(world)
            break
        except ConfigError as err:
            named, text = set(err.fields), in_words(str(err))
        if values.get("strategy") == "hybrid" and {"dp", "tp", "pp"} <= named:
            text += _advice(values, world)
        if text not in found:
            found.append(text)
        if not _neutralise(values, named, world):
            break
    return found


def model_options(current) -> list[tuple[str, object]]:
    """The model dropdown: built-ins, Hugging Face families, `nbpar.register_model`
    names, and the picker's own model when it is a factory."""
    from nbpar.model.registry import display_name, model_names

    names = model_names()
    extra = [] if isinstance(current, str) and current in names else [current]
    return [(display_name(m), m) for m in (*names, *extra)]
