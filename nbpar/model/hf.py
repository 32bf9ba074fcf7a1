"""Hugging Face transformers families, built from a config with random weights.

``"hf:gpt2"``, ``"hf:llama"`` and ``"hf:mixtral"`` build the family's ``*ForCausalLM``
from its config class (``model_config`` overrides small defaults; nothing is downloaded),
then keep its parts as a flat module like TinyGPT: ``embed`` (+ ``pos`` for GPT-2),
``layers`` (a ModuleDict "0".."L-1"), ``norm`` and ``head``. nbpar runs them itself, so a pipeline
stage is the same module with parts set to None, and the parallel plan is declared
once here: Llama's tensor-parallel plan is transformers' own ``base_model_tp_plan``, with
sequence parallelism the layouts torchtitan gives Llama (`llama_block_plan`); the
embedding is split by vocabulary rows and the head by columns (`nbpar.parallel.tensor_ends`).
GPT-2 has none in transformers: its ``c_attn`` computes q, k and v side by side in one
Conv1D (weight ``(d, 3d)``), and DTensor's styles split only ``nn.Linear`` and would cut
the fused output in T contiguous pieces (rank 0 all of q and part of k). nbpar keeps
GPT-2's blocks as the same functions in ``nn.Linear`` form (`linear_from_conv1d`,
`FusedQKV`: q, k and v as three Linear layers whose outputs are concatenated), so the
Megatron split applies by heads: q, k, v and ``mlp.c_fc`` column-wise, ``attn.c_proj`` and
``mlp.c_proj`` row-wise, and `LocalHeads` tells the attention where its local q, k and v
meet. The parameters keep their values; their names change (``attn.c_attn.q.weight``...,
each Linear's weight the transpose of the Conv1D's columns).

Mixtral (Jiang et al. 2024) is the mixture-of-experts family: transformers 5 stores each
layer's experts as two 3-D tensors, expert first (``gate_up_proj`` (E, 2f, d),
``down_proj`` (E, d, f)), called as ``experts(hidden, top_k_index, top_k_weights)``, so
expert parallelism shares them out as it does tiny_moe's (`ModelPlan.experts`); its
tensor-parallel plan (transformers' own) splits the attention only. nbpar runs its
experts with transformers' eager loop and leaves out its router's auxiliary loss
(``output_router_logits`` stays False): that loss is a statistic of the whole batch, which
data-parallel ranks would each compute over their share only; the loss is the
cross entropy alone, on every strategy alike. Each router counts the tokens it routes.
"""

from __future__ import annotations

import torch
from torch import nn

from nbpar.model.plan import ModelPlan, run_layers, token_positions

# small defaults, byte-level vocabulary, untied embeddings (a pipeline can cut them)
FAMILIES = {
    "gpt2": {
        "vocab_size": 256,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "llama": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 2048,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": False,
    },
}
#: Llama 3 70B's published shape (70.6B parameters): a ``model_config`` for "hf:llama" to
#: simulate at full size (`nbpar.simulate`; random weights, nothing downloaded)
LLAMA_3_70B = {
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
}
# config keys of (layers, heads, key/value heads, positions) per family
SHAPE_KEYS = {
    "gpt2": ("n_layer", "n_head", "n_head", "n_positions"),
    "llama": (
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
    ),
}
SHAPE_KEYS["mixtral"] = SHAPE_KEYS["llama"]
#: the transformers classes of each family: (config, causal LM)
CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
TP_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}
#: the name under which transformers' attention registry finds `context_attention_forward`
CONTEXT_ATTENTION = "nbpar_context"


def context_attention_forward(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """An attention function of transformers' registry that calls the module's
    ``context_attention(q, k, v)`` (context parallelism: this rank's share of the tokens
    over the whole causal sequence; no mask, no dropout). q (b, h, s, hd) and k, v
    (b, kv heads, s, hd) in; (b, s, h, hd) out, as the registry's functions return."""
    if attention_mask is not None:
        raise ValueError("context-parallel attention is causal and takes no attention mask")
    out = module.context_attention(query, key, value)  # (b, h, s, hd)
    return out.transpose(1, 2), None


def linear_from_conv1d(conv: nn.Module, lo: int = 0, hi: int | None = None) -> nn.Linear:
    """Output columns ``lo:hi`` of a transformers Conv1D (``y = x W + b``, ``W``: (in, out))
    as an ``nn.Linear`` holding ``W[:, lo:hi]`` transposed: the same function."""
    weight = conv.weight[:, lo:hi]
    # built on the meta device (no initialisation, no RNG draw), then given the values
    linear = nn.Linear(weight.shape[0], weight.shape[1], device="meta", dtype=weight.dtype)
    with torch.no_grad():
        linear.weight = nn.Parameter(weight.t().contiguous())
        linear.bias = nn.Parameter(conv.bias[lo:hi].clone())
    return linear


class FusedQKV(nn.Module):
    """GPT-2's ``c_attn`` as three Linear layers q, k, v whose outputs are concatenated
    (what the Conv1D computed), so each can be split by heads."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        d = conv.weight.shape[0]
        self.q, self.k, self.v = (linear_from_conv1d(conv, i * d, (i + 1) * d) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def _gpt2_as_linear(block: nn.Module) -> None:
    """One GPT2Block's Conv1D layers as Linear layers, in place (same values)."""
    block.attn.c_attn = FusedQKV(block.attn.c_attn)
    block.attn.c_proj = linear_from_conv1d(block.attn.c_proj)
    block.mlp.c_fc = linear_from_conv1d(block.mlp.c_fc)
    block.mlp.c_proj = linear_from_conv1d(block.mlp.c_proj)


def _local_heads_style():
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class LocalHeads(ParallelStyle):
        """GPT2Attention splits c_attn's output in three at ``split_size`` (d); with q, k
        and v column-wise over T ranks each rank's parts are d/T wide."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module.split_size = module.embed_dim // device_mesh.size()
            return module

    return LocalHeads()


def gpt2_block_plan() -> dict:
    """The Megatron split of one GPT2Block (in its Linear form), keyed by submodule path."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.c_attn.q": ColwiseParallel(),
        "attn.c_attn.k": ColwiseParallel(),
        "attn.c_attn.v": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(),
        "attn": _local_heads_style(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }


def llama_block_plan(tp_plan: dict, sequence_parallel: bool = False) -> dict:
    """A LlamaDecoderLayer's split: transformers' ``base_model_tp_plan`` (q, k, v, gate and
    up column-wise, o and down row-wise). With ``sequence_parallel`` the layer's input
    and output hold the tp rank's s/tp tokens (Korthikanti et al. 2022): the RMSNorms run
    on them, the attention and the MLP all-gather their normed input (the attention takes
    it as the keyword ``hidden_states``) and o and down reduce-scatter their output, as
    torchtitan's ``apply_tp`` splits Llama."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as styles

    row = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {
        k.removeprefix("layers.*."): getattr(styles, TP_STYLES[v])(
            **(row if v == "rowwise" else {})
        )
        for k, v in tp_plan.items()
    }
    if sequence_parallel:
        sp = styles.SequenceParallel()
        plan.update(
            input_layernorm=sp,
            post_attention_layernorm=sp,
            self_attn=styles.PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            mlp=styles.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
        )
    return plan


def family(model: str) -> str:
    name = model.removeprefix("hf:")
    if name not in FAMILIES:
        raise ValueError(
            f"model={model!r} is not a known Hugging Face family; choose "
            f"{', '.join('hf:' + f for f in FAMILIES)}"
        )
    return name


def hf_config(model: str, model_config: dict | None):
    """The family's transformers config: defaults, then ``model_config``; one-line errors."""
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"model={model!r} needs the transformers package: pip install 'nbpar[hf]'"
        ) from None
    name = family(model)
    cls = getattr(transformers, CLASSES[name][0])
    values = {**FAMILIES[name], **(model_config or {})}
    try:
        config = cls(**values)
    except Exception as e:
        raise ValueError(f"model_config for {model!r} is not valid: {e}") from None
    known = set(cls().to_dict())
    unknown = sorted(set(model_config or {}) - known)
    if unknown:
        raise ValueError(
            f"model_config key(s) {', '.join(unknown)} are not fields of {cls.__name__}"
        )
    config._attn_implementation = "sdpa"  # causal without a mask
    if name == "mixtral":
        config._experts_implementation = "eager"  # its reference loop over the experts
    return config


def shape(model: str, model_config: dict | None) -> dict:
    """Layers, heads, key/value heads and positions of a family config, without building."""
    name = family(model)
    values = {**FAMILIES[name], **(model_config or {})}
    keys = SHAPE_KEYS[name]
    layers, heads = values.get(keys[0]), values.get(keys[1])
    kv = values.get(keys[2]) or heads
    return {
        "layers": layers,
        "heads": heads,
        "kv_heads": kv,
        "positions": values.get(keys[3], 1024 if name == "gpt2" else 2048),
        "experts": values.get("num_local_experts"),
    }


class HFCausalLM(nn.Module):
    """A transformers decoder's parts, run in order; any part may be None (a stage)."""

    def __init__(self, family_name: str, lm: nn.Module):
        super().__init__()
        self.family = family_name
        self.config = lm.config
        body = lm.transformer if family_name == "gpt2" else lm.model
        if family_name == "gpt2":
            self.embed, self.pos, layers, self.norm = body.wte, body.wpe, body.h, body.ln_f
            self.rotary = None
        else:
            self.embed, self.pos, layers, self.norm = (
                body.embed_tokens,
                None,
                body.layers,
                body.norm,
            )
            self.rotary = body.rotary_emb  # no parameters: every stage keeps it
        if family_name == "gpt2":
            for layer in layers:
                _gpt2_as_linear(layer)
        if family_name == "mixtral":
            from nbpar.model.moe import count_router_output

            for layer in layers:
                layer.mlp.gate.register_forward_hook(count_router_output)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        self.head = lm.lm_head
        self.checkpointing = False  # activation checkpointing: False, "full", "selective"
        # the global positions of the tokens this module is given, where context
        # parallelism hands it some of each sequence's; None = 0..s-1
        self.positions: torch.Tensor | None = None
        # the tp ranks sequence parallelism splits the hidden states over: the embeddings
        # and the blocks give, and a later pipeline stage receives, s / sequence_shards
        # tokens of each sequence
        self.sequence_shards = 1

    def set_context_attention(self, attend) -> None:
        """Every layer's attention calls ``attend(q, k, v)`` (context parallelism), through
        transformers' attention registry; None: back to its SDPA. Llama only."""
        if self.family != "llama":
            raise ValueError(f"context parallelism runs hf:llama, not hf:{self.family}")
        from transformers import AttentionInterface

        AttentionInterface.register(CONTEXT_ATTENTION, context_attention_forward)
        for layer in self.layers.values():
            layer.self_attn.context_attention = attend
        self.config._attn_implementation = "sdpa" if attend is None else CONTEXT_ATTENTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x  # ids (b, s) -> (b, s, d)
        s = h.shape[1] * self.sequence_shards  # the whole sequence's positions (or cp's share)
        positions = token_positions(self.positions, s, h.device).unsqueeze(0)  # (1, s)
        if self.pos is not None:
            h = h + self.pos(positions)
        kwargs = {}
        if self.rotary is not None:
            kwargs = {"position_embeddings": self.rotary(h, positions), "position_ids": positions}
        h = run_layers(self.layers, h, self.checkpointing, **kwargs)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h  # (b, s, vocab) logits

    def parallel_plan(self) -> ModelPlan:
        tied = (
            self.embed is not None
            and self.head is not None
            and self.embed.weight is self.head.weight
        )
        first = ("embed", "pos")
        if self.family in ("llama", "mixtral"):
            c = self.config
            widths = {
                "number of attention heads": c.num_attention_heads,
                "number of key/value heads": c.num_key_value_heads,
            }
            if self.family == "llama":
                widths["MLP width"] = c.intermediate_size
            return ModelPlan(
                layers=self.layers,
                tp=llama_block_plan(c.base_model_tp_plan),
                tp_widths=widths,
                first=first,
                last=("norm", "head"),
                no_pipeline="its embeddings are tied to the head (set tie_word_embeddings=False)"
                if tied
                else None,
                experts="mlp.experts" if self.family == "mixtral" else None,
                sp=llama_block_plan(c.base_model_tp_plan, sequence_parallel=True)
                if self.family == "llama"
                else None,
                head="head",
                embed="embed",
                norm="norm",
            )
        c = self.config
        return ModelPlan(
            layers=self.layers,
            tp=gpt2_block_plan(),
            tp_widths={
                "number of attention heads": c.n_head,
                "MLP width": 4 * c.n_embd if c.n_inner is None else c.n_inner,
            },
            first=first,
            last=("norm", "head"),
            no_pipeline="its embeddings are tied to the head (set tie_word_embeddings=False)"
            if tied
            else None,
            head="head",
            embed="embed",
        )


def build_hf_model(model: str, model_config: dict | None, seq_len: int) -> HFCausalLM:
    """Family ``model`` with random weights from the caller's RNG state."""
    import transformers

    config = hf_config(model, model_config)
    positions = shape(model, model_config)["positions"]
    if seq_len > positions:
        raise ValueError(f"seq_len={seq_len} exceeds {model}'s {positions} positions")
    name = family(model)
    return HFCausalLM(name, getattr(transformers, CLASSES[name][1])(config))
