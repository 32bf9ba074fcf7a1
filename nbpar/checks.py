"""The checks every setting shares: a whole number of at least some minimum, one of a
list of choices. Each raises `nbpar.errors.ConfigError` naming the setting, so a widget
or the CLI can point at the box or flag to change. Pure Python, at the bottom layer."""

from __future__ import annotations

import contextlib
from numbers import Integral

from nbpar.errors import ConfigError


def positive_int(name: str, value, *, minimum: int = 1, optional: bool = False) -> int | None:
    """``value`` as an int when it is a whole number >= ``minimum`` (``True`` is not one);
    None passes when ``optional``. Else ConfigError naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if optional:
            what += " or None"
        raise ConfigError(f"{name} must be {what}, got {value!r}", fields=(name,))
    return int(value)


def choice(name: str, value, allowed) -> None:
    """ConfigError naming ``name`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(
            f"{name}={value!r} is not supported; choose one of {', '.join(map(str, allowed))}",
            fields=(name,),
        )


#: activation checkpointing's kinds (Korthikanti et al. 2022): "full" recomputes each
#: block in backward, "selective" only its attention core
CHECKPOINTING = ("full", "selective")


def checkpointing_kind(value) -> str | None:
    """``TrainConfig.activation_checkpointing`` as a kind: None (off), "full" (True, as
    before there were kinds) or "selective"; ConfigError for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return "full"
    if isinstance(value, str) and value in CHECKPOINTING:
        return value
    raise ConfigError(
        f"activation_checkpointing must be False, True, 'full' or 'selective', got {value!r}",
        fields=("activation_checkpointing",),
    )


@contextlib.contextmanager
def about(*fields: str):
    """Name ``fields`` in a ValueError that a check inside raises without naming its
    setting (a ConfigError passes unchanged)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err), fields=fields) from None
