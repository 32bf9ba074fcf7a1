"""The two teaching models: a one-conv CNN and a tiny pre-norm GPT.

TinyGPT follows GPT-2 (Radford et al., 2019): token + position embeddings,
pre-norm blocks of causal self-attention and a GELU MLP, final LayerNorm and a
vocabulary head. Its parts are plain attributes so strategies can cut it:
a pipeline stage sets ``tok_emb``/``head`` to None and drops layers (GPipe,
Huang et al. 2019), tensor parallelism shards ``wq``/``wk``/``wv``/``w1``
column-wise and ``wo``/``w2`` row-wise (Megatron-LM, Shoeybi et al. 2019).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nbpar.checks import checkpointing_kind
from nbpar.model.plan import run_layers, token_positions

# Sizes arrive as a `nbpar.config.GPTConfig`; it is not imported here, since the config
# builds a model to check a resume (an import would be a cycle).


class SimpleCNN(nn.Module):
    """conv3x3(3->32) -> ReLU -> global average pool -> linear(32->classes)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(x))  # (b, 3, 32, 32) -> (b, 32, 32, 32)
        x = torch.flatten(self.pool(x), 1)  # (b, 32)
        return self.fc(x)  # (b, classes)


class Attention(nn.Module):
    """Causal multi-head self-attention; the head count is read off the tensor,
    so a tensor-parallel shard holding fewer heads runs the same code."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        self.dropout = cfg.dropout
        self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.wo = nn.Linear(d, d)
        # context parallelism's attention over a sequence split across ranks, set by
        # `nbpar.parallel.cp.apply_cp`: (q, k, v) -> out, each (b, h, local tokens, hd)
        self.context: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, d) @ (d, d) -> (b, s, h, hd) -> (b, h, s, hd); h = local heads
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        if self.context is not None:  # this rank holds some of the tokens (no dropout)
            y = self.context(q, k, v)
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, h*hd) @ (d, d)


class FeedForward(nn.Module):
    """Position-wise MLP: up-projection, GELU, down-projection."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.w1 = nn.Linear(d, cfg.ffn_mult * d)  # up
        self.w2 = nn.Linear(cfg.ffn_mult * d, d)  # down
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.w2(F.gelu(self.w1(x))))  # (b, s, d) -> (b, s, 4d) -> (b, s, d)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TinyGPT(nn.Module):
    """Decoder-only transformer over byte tokens; any part may be None (a stage)."""

    def __init__(self, cfg, block=Block):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        # ``block(cfg)`` makes one block (tiny_moe's has experts for a feed-forward)
        self.layers = nn.ModuleDict({str(i): block(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.checkpointing = False  # activation checkpointing: False, "full", "selective"
        # the global positions of the tokens this module is given, where context
        # parallelism hands it some of each sequence's (`nbpar.parallel.cp`); None = 0..s-1
        self.positions: torch.Tensor | None = None
        self.apply(_init_weights)

    def parallel_plan(self):
        """Blocks, the Megatron split of each block, and the pipeline ends."""
        from nbpar.model.plan import ModelPlan

        c = self.cfg
        return ModelPlan(
            layers=self.layers,
            tp=gpt_block_plan(),
            tp_widths={
                "number of attention heads": c.n_heads,
                "model width d_model": c.d_model,
                "feed-forward width": c.ffn_mult * c.d_model,
            },
            first=("tok_emb", "pos_emb"),
            last=("norm", "head"),
            sp=gpt_block_plan(sequence_parallel=True),
            head="head",
            embed="tok_emb",
            norm="norm",
            sp_inputs={"pos_emb": 0},  # (s, d), added to tok_emb's (b, s, d)
        )

    def set_context_attention(self, attend: Callable | None) -> None:
        """Every block attends with ``attend(q, k, v)`` (context parallelism: this rank's
        share of each sequence over the whole of it); None: ordinary causal attention."""
        for block in self.layers.values():
            block.attn.context = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = run_layers(self.layers, self.embed(x), self.checkpointing)
        return self.finish(h)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (b, s) -> hidden (b, s, d); a later pipeline stage's hidden states
        pass through. Positions are the tokens' own (`token_positions`: global ones where
        context parallelism gave this rank a share of each sequence)."""
        if self.tok_emb is None:
            return x
        h = self.tok_emb(x)
        if self.pos_emb is not None:
            h = h + self.pos_emb(token_positions(self.positions, x.shape[1], x.device))
        return h

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the head where this stage has them: (b, s, d) -> logits."""
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)  # (b, s, d) @ (d, vocab) -> logits
        return h


class TinyMoE(TinyGPT):
    """TinyGPT whose blocks' feed-forwards are mixtures of experts (`nbpar.model.moe`):
    returns (logits, balance loss per sequence (b,)); a pipeline stage takes and returns
    (hidden, balance loss so far), so the loss reaches the last stage whole."""

    def __init__(self, cfg, moe):
        from nbpar.model.moe import MoEFeedForward

        def block(c):
            b = Block(c)
            b.ffn = MoEFeedForward(c, moe)
            return b

        super().__init__(cfg, block=block)

    def parallel_plan(self):
        """TinyGPT's, less the feed-forward split: each expert stays whole on every
        tensor-parallel rank; expert parallelism shares out ``ffn.experts``."""
        plan = super().parallel_plan()
        plan.tp = {k: v for k, v in plan.tp.items() if not k.startswith("ffn.")}
        plan.tp_widths.pop("feed-forward width")
        plan.experts = "ffn.experts"
        plan.sp = None  # no sequence-parallel split of the experts' blocks
        return plan

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None):
        if isinstance(x, tuple):  # DeepSpeed's pipeline hands a stage its inputs as one
            x, aux = x
        out = super().forward(x)  # logits, or hidden states on a stage without the head
        total = aux if aux is not None else out.new_zeros(out.shape[0], dtype=torch.float32)
        for block in self.layers.values():
            total = total + block.ffn.aux  # (b,)
        return out, total


def gpt_block_plan(sequence_parallel: bool = False) -> dict:
    """The Megatron split of one TinyGPT Block, keyed by submodule path. With
    ``sequence_parallel`` (Korthikanti et al. 2022) the block's input and output hold the
    tp rank's s/tp tokens: the norms and the feed-forward's dropout run on them, each
    sub-layer all-gathers its normed input and reduce-scatters its output, the layouts
    torchtitan's ``apply_tp`` gives Llama."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sequence_parallel else Replicate()  # (b, s/tp, d) or (b, s, d)
    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=out),
        "ffn.w1": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=out),
    }
    if sequence_parallel:
        # (b, s/tp, d) -> (b, s, d) into q, k, v and w1; backward reduce-scatters it
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        norm = SequenceParallel()
        plan.update(attn_norm=norm, attn=gather, ffn_norm=norm, ffn=gather)
    return plan


def _init_weights(m: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)


def build_model(cfg) -> nn.Module:
    """The model of ``cfg`` with weights fixed by ``cfg.seed`` alone.

    The global RNG is forked, so building a model neither depends on nor
    changes what the caller's RNG did; every rank gets identical weights.
    Built-ins, Hugging Face families and factories alike (`nbpar.model.registry`).
    """
    from nbpar.model import registry

    kind = registry.kind(cfg.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model == "simple_cnn":
            model = SimpleCNN(num_classes=10)
        elif cfg.model == "tiny_gpt":
            model = TinyGPT(cfg.gpt)
        elif cfg.model == "tiny_moe":
            model = TinyMoE(cfg.gpt, cfg.moe)
        elif kind == "hf":
            from nbpar.model.hf import build_hf_model

            model = build_hf_model(cfg.model, cfg.model_config, cfg.gpt.seq_len)
        else:
            model = _call_factory(cfg)
    kind = checkpointing_kind(cfg.activation_checkpointing)
    if kind is not None:
        if not hasattr(model, "checkpointing"):
            raise ValueError(
                f"activation_checkpointing needs a model that runs its blocks "
                f"through nbpar.model.plan.run_layers (tiny_gpt, hf:*); "
                f"{type(model).__name__} does not"
            )
        model.checkpointing = kind
    return model


def _call_factory(cfg) -> nn.Module:
    """Call a model factory (``model_config`` as keyword arguments); one-line errors."""
    from nbpar.model import registry

    spec = cfg.model
    if registry.kind(spec) == "registered":
        spec = registry.registered()[spec].factory
    factory = registry.resolve_callable(spec, "model")
    name = registry.display_name(cfg.model)
    try:
        model = factory(**(cfg.model_config or {}))
    except Exception as e:
        raise ValueError(f"model factory {name} raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model factory {name} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (b, classes) logits vs (b,) labels."""
    return F.cross_entropy(logits.float(), targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (b, s, vocab) logits vs (b, s) next tokens, over all b*s."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def loss_fn(cfg_or_model):
    """The training loss of a config (its ``loss``, else its model's) or of a built-in
    model name; module-level functions or the user's own, so they pickle."""
    from nbpar.model import registry

    loss, model = getattr(cfg_or_model, "loss", None), getattr(cfg_or_model, "model", cfg_or_model)
    kind = registry.kind(model)
    if loss is None and kind == "registered":
        loss = registry.registered()[model].loss
    if loss is not None:
        return registry.resolve_callable(loss, "loss")
    if model == "simple_cnn":
        return classification_loss
    if model == "tiny_moe":
        from nbpar.model.moe import moe_loss

        return moe_loss
    if model == "tiny_gpt" or kind == "hf":
        return next_token_loss
    raise ValueError(
        f"model={registry.display_name(model)} needs loss= (a function "
        f"loss(output, target) or its 'package.module:function')"
    )
