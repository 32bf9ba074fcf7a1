"""Model shapes, seed determinism and pipeline-style stage cutting."""

import torch

from nbpar.config import GPTConfig, TrainConfig
from nbpar.model.models import Attention, Block, SimpleCNN, TinyGPT, build_model, loss_fn


def test_simple_cnn_shapes_and_loss():
    m = build_model(TrainConfig(model="simple_cnn"))
    assert isinstance(m, SimpleCNN)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 9])
    logits = m(x)
    assert logits.shape == (4, 10)
    loss = loss_fn("simple_cnn")(logits, y)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, y))


def test_tiny_gpt_shapes_and_attribute_layout():
    cfg = TrainConfig(model="tiny_gpt")
    m = build_model(cfg)
    assert isinstance(m, TinyGPT)
    assert list(m.layers.keys()) == ["0", "1"]
    blk = m.layers["0"]
    assert isinstance(blk, Block) and isinstance(blk.attn, Attention)
    assert blk.attn.head_dim == cfg.gpt.d_model // cfg.gpt.n_heads
    assert m.head.bias is None and blk.ffn.w1.out_features == 4 * cfg.gpt.d_model
    x = torch.randint(0, 256, (3, cfg.gpt.seq_len))
    logits = m(x)
    assert logits.shape == (3, cfg.gpt.seq_len, 256)
    loss = loss_fn("tiny_gpt")(logits, x)
    assert loss.shape == () and 5.0 < loss.item() < 6.0  # ~ln(256) at init


def test_causal_attention_ignores_the_future():
    m = build_model(TrainConfig(model="tiny_gpt"))
    x = torch.randint(0, 256, (2, 16))
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256
    torch.testing.assert_close(m(x)[:, :10], m(x2)[:, :10])
    assert not torch.allclose(m(x)[:, 10:], m(x2)[:, 10:])


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(TrainConfig(seed=3))
    after = torch.rand(1)
    torch.testing.assert_close(before, after)  # build_model did not consume global RNG
    b = build_model(TrainConfig(seed=3))
    c = build_model(TrainConfig(seed=4))
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0)
    assert not torch.equal(a.head.weight, c.head.weight)


def test_stages_cut_from_the_model_compose_to_the_whole():
    cfg = GPTConfig(n_layers=4)
    full = build_model(TrainConfig(gpt=cfg, seed=1))
    first = build_model(TrainConfig(gpt=cfg, seed=1))
    last = build_model(TrainConfig(gpt=cfg, seed=1))
    first.norm = first.head = None
    del first.layers["2"], first.layers["3"]
    last.tok_emb = last.pos_emb = None
    del last.layers["0"], last.layers["1"]
    x = torch.randint(0, 256, (2, cfg.seq_len))
    hidden = first(x)
    assert hidden.shape == (2, cfg.seq_len, cfg.d_model)
    torch.testing.assert_close(last(hidden), full(x))


def test_attention_runs_with_fewer_local_heads():
    """Megatron split by hand: two shards of 2 heads each sum to the 4-head output."""
    from torch import nn

    cfg = GPTConfig(d_model=32, n_heads=4)
    torch.manual_seed(0)
    full = Attention(cfg)
    x = torch.randn(2, 8, 32)
    out = torch.zeros(2, 8, 32)
    for k in range(2):
        cols = slice(16 * k, 16 * (k + 1))
        shard = Attention(cfg)
        for name in ("wq", "wk", "wv"):  # column-parallel: output features split
            w = getattr(full, name)
            lin = nn.Linear(32, 16)
            lin.weight.data, lin.bias.data = w.weight[cols].clone(), w.bias[cols].clone()
            setattr(shard, name, lin)
        lin = nn.Linear(16, 32)  # row-parallel: input features split, bias added once
        lin.weight.data = full.wo.weight[:, cols].clone()
        lin.bias.data = full.wo.bias.clone() if k == 0 else torch.zeros(32)
        shard.wo = lin
        out = out + shard(x)
    torch.testing.assert_close(out, full(x))
