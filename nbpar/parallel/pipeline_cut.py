"""How a model is cut into pipeline stages and which pp rank holds each.

The cut follows the model's declared plan (`nbpar.model.plan`); ``pp * virtual`` stages
of contiguous layers sit round-robin on the ranks ("loop": GPipe, 1F1B, interleaved
1F1B) or, for the zero-bubble V schedules (ZB-V, Qi et al. 2023; DualPipeV, DeepSeek-V3
2024), two per rank in a V ("v"): stages r and 2p-1-r, so a micro-batch turns around on
the last rank without a send and its loss is computed on rank 0.
"""

from __future__ import annotations

import copy

from torch import nn

from nbpar.model.plan import plan_of, require
from nbpar.strategies import V_SCHEDULES


def stage_ids(pp_rank: int, pp_size: int, virtual: int = 1, style: str = "loop") -> list[int]:
    """Stages held by ``pp_rank``: round-robin ("loop"), ``pp_rank + k * pp_size``; or
    in a V ("v", two per rank), ``pp_rank`` and ``2 * pp_size - 1 - pp_rank``, so the
    last stage sits on pp rank 0 (torch's ``generate_stage_to_rank_mapping`` styles)."""
    if style == "v":
        if virtual != 2:
            raise ValueError(f"a V holds 2 stages per rank, got virtual={virtual}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(virtual)]


def stage_style(schedule: str) -> str:
    """How ``schedule`` places stages on ranks: "v" or "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Split ``n_layers`` blocks into ``n_stages`` contiguous runs, sizes differing <= 1."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def split_stages(
    model: nn.Module,
    pp_rank: int,
    pp_size: int,
    virtual: int = 1,
    style: str = "loop",
    *,
    in_place: bool = False,
) -> list[nn.Module]:
    """The stage modules of ``pp_rank`` (placed by ``style``, `stage_ids`): copies of
    ``model`` keeping only their part.

    The cut follows the model's declared plan (`nbpar.model.plan`): stage 0 keeps
    its ``first`` parts (embeddings), the last stage its ``last`` parts (norm, head);
    parameter names stay those of the full model. ``model`` is not modified, unless
    ``in_place`` (one chunk only): then it is cut itself, as a simulated rank does with
    the fake model it built for its stage (a copied fake tensor's views do not share its
    storage, which a memory meter would count as new memory).
    """
    plan = require(model, "pipeline")
    n_layers = len(plan.layers)
    for name, value in (("pp_size", pp_size), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    n_stages = pp_size * virtual
    if n_stages > n_layers:
        raise ValueError(
            f"cannot cut {n_layers} layers into pp*virtual = "
            f"{pp_size}*{virtual} = {n_stages} stages: need at most one "
            f"stage per layer"
        )
    keys = sorted(plan.layers.keys(), key=int)
    ranges = layer_ranges(n_layers, n_stages)
    if in_place and virtual != 1:
        raise ValueError("split_stages(in_place=True) cuts one chunk; virtual must be 1")
    chunks = []
    for s in stage_ids(pp_rank, pp_size, virtual, style):
        chunk = model if in_place else copy.deepcopy(model)
        layers = plan_of(chunk).layers
        for i, key in enumerate(keys):
            if i not in ranges[s]:
                del layers[key]
        for name in (plan.first if s != 0 else ()) + (plan.last if s != n_stages - 1 else ()):
            setattr(chunk, name, None)
        chunks.append(chunk)
    return chunks
