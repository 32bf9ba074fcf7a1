"""Hugging Face transformers families, built from a config with random weights.

``"hf:gpt2"`` and ``"hf:llama"`` build the family's ``*ForCausalLM`` from its config
class (``model_config`` overrides small defaults; nothing is downloaded), then keep
its parts as a flat module like TinyGPT: ``embed`` (+ ``pos`` for GPT-2), ``layers``
(a ModuleDict "0".."L-1"), ``norm`` and ``head``. nbpar runs them itself, so a pipeline
stage is the same module with parts set to None, and the parallel plan is declared
once here: Llama's tensor-parallel plan is transformers' own ``base_model_tp_plan``;
GPT-2's fused ``c_attn`` (a Conv1D) has none.
"""

from __future__ import annotations

import torch
from torch import nn

from nbpar.train.plan import ModelPlan, run_layers

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
TP_STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


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
    cls = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}[name]
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
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        self.head = lm.lm_head
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x  # ids (b, s) -> (b, s, d)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, s)
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
        if self.family == "llama":
            from torch.distributed.tensor import parallel

            plan = {
                k.removeprefix("layers.*."): getattr(parallel, TP_STYLES[v])()
                for k, v in self.config.base_model_tp_plan.items()
            }
            c = self.config
            widths = {
                "number of attention heads": c.num_attention_heads,
                "number of key/value heads": c.num_key_value_heads,
                "MLP width": c.intermediate_size,
            }
            return ModelPlan(
                layers=self.layers,
                tp=plan,
                tp_widths=widths,
                first=first,
                last=("norm", "head"),
                no_pipeline="its embeddings are tied to the head (set tie_word_embeddings=False)"
                if tied
                else None,
            )
        return ModelPlan(
            layers=self.layers,
            first=first,
            last=("norm", "head"),
            no_tp="fuses q, k and v in one Conv1D (c_attn), which DTensor's "
            "Colwise/Rowwise styles cannot split by heads",
            no_pipeline="its embeddings are tied to the head (set tie_word_embeddings=False)"
            if tied
            else None,
        )


def build_hf_model(model: str, model_config: dict | None, seq_len: int) -> HFCausalLM:
    """Family ``model`` with random weights from the caller's RNG state."""
    import transformers

    config = hf_config(model, model_config)
    positions = shape(model, model_config)["positions"]
    if seq_len > positions:
        raise ValueError(f"seq_len={seq_len} exceeds {model}'s {positions} positions")
    name = family(model)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[name]
    return HFCausalLM(name, cls(config))
