"""Bytes each rank sends per optimizer step, by strategy: the estimator's communication
model, which `nbpar.measure.comm`'s counts at the c10d layer are checked against (the
ZeRO paper's ring accounting, and where each implementation moves more).
Pure Python, like `nbpar.estimate`.
"""

from __future__ import annotations

from nbpar.checks import positive_int
from nbpar.estimate import _choice
from nbpar.strategies import ATTENTIONS, STRATEGIES, ZERO_STAGE


def comm_bytes_per_step(
    strategy: str,
    *,
    param_bytes: float,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    backend: str = "torch",
    grad_accum: int = 1,
    activation_bytes: float = 0.0,
    layers: int = 0,
    pp_stage: int = 0,
    logits_bytes: float = 0.0,
    sequence_parallel: bool = False,
    column_linears: int = 4,
) -> float:
    """Bytes one rank sends in one optimizer step, by the ring accounting of the ZeRO
    paper (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n of the whole).

    ``param_bytes`` is the whole model's parameter bytes (Psi), ``activation_bytes``
    one micro-batch's hidden states (b * s * d * element size), ``logits_bytes`` its
    logits (b * s * vocab * element size): given, tp splits the embedding and the output
    layer too, as nbpar's plans do.
    The paper's figures are 2 Psi for DDP and ZeRO-1/2 and 3 Psi for ZeRO-3 (times (n-1)/n); the
    implementations differ where said, as measured at the c10d layer
    (`nbpar.measure.comm`), with K micro-batches per step:

    - torch zero1: ZeroRedundancyOptimizer all-reduces whole gradients, then each rank
      broadcasts its updated partition: 3 Psi.
    - torch zero2 (FSDP2 without resharding after forward): parameters are resharded
      after each backward, so every micro-batch gathers them again: (K + 1) Psi.
    - torch zero3 (FSDP2): a gather in forward and in backward per micro-batch: (2K + 1) Psi.
    - deepspeed zero1 / zero2: gradients are averaged with all-reduce, not
      reduce-scatter (zero2 at every micro-batch), then the updated partitions are
      all-gathered: 3 Psi / (2K + 1) Psi.
    - deepspeed zero3: a parameter used again within ``stage3_max_reuse_distance``
      (default 1e9 elements) stays gathered from forward to backward, so small models
      gather once per micro-batch and reduce-scatter per micro-batch: 2K Psi.
    - tp (Megatron, Shoeybi et al. 2019): 2 all-reduces of the hidden states per layer
      in forward and 2 in backward; DTensor reduces the input gradient of each
      column-parallel Linear apart (``column_linears`` a layer: Q, K, V and the MLP's
      first, 4, in tiny_gpt; 5 with Llama's gate and up): 6 per layer in tiny_gpt, per
      micro-batch. The embedding, split by vocabulary, all-reduces its lookups; the
      output layer, split by columns, all-gathers the logits and all-reduces its
      input's gradient.
    - tp with ``sequence_parallel`` (Korthikanti et al. 2022): each all-reduce becomes a
      reduce-scatter and an all-gather of the same tensor, which together move what it
      moved; the all-gathered input is shared by Q, K and V, so its gradient is
      reduce-scattered once: per layer 4 all-gathers and 4 reduce-scatters, Megatron's 4
      all-reduces. The embedding reduce-scatters its lookups (all-gathers their gradient
      in backward); the output layer all-gathers its input and the logits and
      reduce-scatters its input's gradient.
    - pipeline: each boundary carries one activation forward and one gradient back per
      micro-batch; a first or last stage sends K tensors, a middle stage 2K.
    """
    _choice("strategy", strategy, STRATEGIES)
    k = positive_int("grad_accum", grad_accum)
    ring = (dp - 1) / dp * param_bytes
    if strategy == "ddp":
        return 2 * ring
    if ZERO_STAGE.get(strategy):
        times = {
            ("zero1", "torch"): 3,
            ("zero2", "torch"): k + 1,
            ("zero3", "torch"): 2 * k + 1,
            ("zero1", "deepspeed"): 3,
            ("zero2", "deepspeed"): 2 * k + 1,
            ("zero3", "deepspeed"): 2 * k,
        }[(strategy, backend)]
        return times * ring
    if strategy == "tp":
        ring_a, ring_l = (tp - 1) / tp * activation_bytes, (tp - 1) / tp * logits_bytes
        ends = 4 * ring_a + ring_l if logits_bytes else 0  # embedding and head split
        if sequence_parallel:
            return k * (layers * 8 * ring_a + ends)
        return k * (layers * (2 + column_linears) * 2 * ring_a + ends)
    if strategy == "pipeline":
        middle = 0 < pp_stage < pp - 1
        return k * activation_bytes * (2 if middle else 1) if pp > 1 else 0.0
    raise ValueError(
        f"no communication model for strategy {strategy!r}; compose hybrid "
        f"layouts from their dimensions"
    )


def context_bytes_per_step(
    attention: str,
    *,
    cp: int,
    layers: int,
    kv_bytes: float,
    q_bytes: float | None = None,
    grad_accum: int = 1,
    recompute: bool = False,
) -> float:
    """Bytes one rank sends for attention over a sequence split in ``cp`` (the
    gradients' all-reduce over dp x cp comes on top, as `comm_bytes_per_step`'s ddp).

    ``kv_bytes``: one rank's share of k (or of v) in one layer and micro-batch,
    b * s / cp * kv_heads * head_dim * element size; ``q_bytes`` the same of q and of the
    attention output (heads instead of kv_heads; default ``kv_bytes``). Ulysses splits
    heads: where cp does not divide the key/value heads, they are repeated to the query
    heads before the all-to-all, and ``kv_bytes`` counts those.

    - ring (Liu et al. 2023): the forward passes ``cp - 1`` K/V block pairs on, the
      backward the same again and ``cp`` pairs of their gradients (the last hop brings
      them home): 2 kv (2 (cp-1) + cp) per layer; full activation checkpointing runs
      the forward again in backward, ``cp - 1`` pairs more.
    - ulysses (Jacobs et al. 2023): four all-to-alls in the forward (q, k, v, output)
      and four in the backward, each sending (cp-1)/cp of its tensor: 2 (2 q + 2 kv)
      (cp-1)/cp per layer; recomputation adds the forward's four.
    """
    _choice("attention", attention, ATTENTIONS)
    cp, layers = positive_int("cp", cp), positive_int("layers", layers)
    k = positive_int("grad_accum", grad_accum)
    q = kv_bytes if q_bytes is None else q_bytes
    forwards = 2 + bool(recompute)  # passes of the forward's traffic per step
    if attention == "ring":
        per_layer = 2 * kv_bytes * (forwards * (cp - 1) + cp)
    else:
        per_layer = forwards * (2 * q + 2 * kv_bytes) * (cp - 1) / cp
    return k * layers * per_layer


def expert_bytes_per_step(
    *,
    ep: int,
    moe_layers: int,
    tokens: int,
    top_k: int,
    row_bytes: float,
    n_experts: int,
    grad_accum: int = 1,
    recompute: bool = False,
) -> float:
    """All-to-all bytes one rank sends for expert parallelism over ``ep`` ranks, with
    every expert chosen equally often (the routing `nbpar.simulate` assumes; a real
    run's follow its measured routing, `tokens_per_expert`).

    Per MoE layer and micro-batch of ``tokens`` tokens: the int64 counts (E of them,
    (ep-1)/ep sent on), the dispatch (each token's ``top_k`` rows of ``row_bytes``, the
    (ep-1)/ep bound for other ranks) and the combine (as many rows back), and both again
    in backward; full activation checkpointing repeats the forward's three.
    """
    ep, layers = positive_int("ep", ep), positive_int("moe_layers", moe_layers)
    k = positive_int("grad_accum", grad_accum)
    away = (ep - 1) / ep
    rows = tokens * top_k * away * row_bytes
    counts = n_experts * 8 * away
    forwards = 1 + bool(recompute)
    return k * layers * (forwards * (counts + 2 * rows) + 2 * rows)
