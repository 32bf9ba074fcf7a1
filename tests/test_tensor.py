"""Tensor parallelism against a single-process reference, on real gloo processes.

Every check compares the tp-split computation with the same computation on the
unsplit module (same seed, same weights): outputs, input gradients, the full
(gathered) gradient of every weight, and 20 optimizer steps of TinyGPT.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing import assert_close

from nbpar.config import GPTConfig
from nbpar.dims import ParallelDims
from nbpar.model.models import Attention, FeedForward
from nbpar.parallel.tensor import apply_tp, block_plan, build_runner, check_tp
from tests.distributed import run_distributed
from tests.reference.gpt import SIZES, batches, make_cfg, make_model, reference_run
from tests.reference.gpt import lm_loss as gpt_loss

GPT = GPTConfig(**{**SIZES, "n_layers": 2})


def make_gpt():
    return make_model(n_layers=GPT.n_layers)


def train_cfg(strategy: str = "tp", **kw):
    return make_cfg(strategy=strategy, gpt=GPT, **kw)


def steps_of(n_steps: int, accum: int, micro: int) -> list:
    """The micro-batches of global steps 0..n_steps-1 (`tests.reference.gpt.batches`)."""
    return [batches(s, accum, micro) for s in range(n_steps)]


def reference_losses(n_steps: int, accum: int, micro: int, autocast_dtype=None):
    return reference_run(n_steps, accum, micro, autocast_dtype, n_layers=GPT.n_layers)


def drop_key_bias(params: dict) -> dict:
    """Parameters minus wk.bias: its exact gradient is 0 (softmax ignores a
    per-query constant q.b_k), so Adam's m/sqrt(v) turns rounding noise of size
    1e-9 into lr-sized steps that differ between any two summation orders."""
    return {k: v for k, v in params.items() if not k.endswith("attn.wk.bias")}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --- workers (module level: spawned processes import them) ---


def _layers_worker(rank, world):
    mesh = ParallelDims(tp=world, world_size=world).build_mesh("cpu")
    return {kind: check_layer(mesh, kind) for kind in ("ffn", "attn")}


def check_layer(mesh, kind):
    """Split FeedForward or Attention on tp ranks; assert it equals the unsplit one."""
    world = mesh["tp"].size()
    torch.manual_seed(0)  # torch's default Linear init: non-zero biases too
    layer = FeedForward(GPT) if kind == "ffn" else Attention(GPT)
    ref = copy.deepcopy(layer)
    plan = {
        k.split(".", 1)[1]: style for k, style in block_plan().items() if k.startswith(kind + ".")
    }  # the production plan, relative to the layer
    parallelize_module(layer, mesh["tp"], plan)
    first = layer.w1 if kind == "ffn" else layer.wq
    assert first.weight.to_local().shape[0] == first.out_features // world
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(2))
    x_tp, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, out_ref = layer(x_tp), ref(x_ref)
    assert_close(out, out_ref)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad_out)
    out_ref.backward(grad_out)
    assert_close(x_tp.grad, x_ref.grad)
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        assert_close(full(p.grad), ref_params[name].grad, msg=lambda m, n=name: f"{n}: {m}")
    return len(ref_params)


def _gpt_grads_worker(rank, world):
    mesh = ParallelDims(tp=world, world_size=world).build_mesh("cpu")
    model, ref = make_gpt(), make_gpt()
    apply_tp(model, mesh["tp"])
    ((x, y),) = batches(0, accum=1, micro=4)
    logits = model(x)
    assert_close(logits, ref(x))
    gpt_loss(logits, y).backward()
    gpt_loss(ref(x), y).backward()
    ref_params = dict(ref.named_parameters())
    assert ref_params["layers.0.attn.wk.bias"].grad.abs().max() < 1e-6  # see drop_key_bias
    replicated = {}
    for name, p in model.named_parameters():
        assert_close(full(p.grad), ref_params[name].grad, msg=lambda m, n=name: f"{n}: {m}")
        if not hasattr(p, "full_tensor"):
            replicated[name] = p.grad.numpy().copy()  # numpy: tensors don't cross queues
    return replicated


def _gpt_train_worker(rank, world, n_steps, accum):
    mesh = ParallelDims(tp=world, world_size=world).build_mesh("cpu")
    steps = steps_of(n_steps, accum, 4)
    model = make_gpt()
    runner = build_runner(model, train_cfg("tp"), mesh, loss_fn=gpt_loss)
    losses = [runner.train_step(mbs).item() for mbs in steps]
    params = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    memory = runner.memory()["param_bytes"], sum(p.numel() * 4 for p in make_gpt().parameters())
    # bf16 autocast: same math in lower precision, against a bf16 single-process run
    model = make_gpt()
    runner = build_runner(model, train_cfg("tp", precision="bf16"), mesh, loss_fn=gpt_loss)
    bf16_losses = [runner.train_step(mbs) for mbs in steps[:3]]
    if rank == 0:  # the reference runs once; both ranks hold the same losses and full params
        ref_losses, ref_params = reference_losses(n_steps, accum, 4)
        assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=0)
        assert_close(drop_key_bias(params), drop_key_bias(ref_params))
        bf16_ref, _ = reference_losses(3, accum, 4, autocast_dtype=torch.bfloat16)
        bf16 = torch.tensor([loss.item() for loss in bf16_losses])
        assert_close(bf16, torch.tensor(bf16_ref), atol=2e-2, rtol=0)
    return memory, losses


def _dp_tp_worker(rank, world, strategies, n_steps, accum):
    """Each strategy on dp=2 x tp=2: dp rank j takes half j of every global micro-batch."""
    import torch.distributed as dist

    dims = ParallelDims(dp=2, tp=world // 2, world_size=world)
    mesh = dims.build_mesh("cpu")
    dp_rank = dims.coords(rank)["dp"]
    global_steps = steps_of(n_steps, accum, 8)  # the single process sees batch 8
    mine = [
        [(x[4 * dp_rank : 4 * dp_rank + 4], y[4 * dp_rank : 4 * dp_rank + 4]) for x, y in step]
        for step in global_steps
    ]
    ref_losses, ref_params = reference_losses(n_steps, accum, 8) if rank == 0 else (None, None)
    memory = {}
    for strategy in strategies:
        model = make_gpt()
        runner = build_runner(model, train_cfg(strategy), mesh, loss_fn=gpt_loss)
        losses = []
        for mbs in mine:
            loss = runner.train_step(mbs)
            dist.all_reduce(loss, group=mesh["dp"].get_group())  # mean over dp ranks
            losses.append(loss.item() / 2)
        params = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
        if rank == 0:  # losses and gathered params are the same on every rank
            assert_close(
                torch.tensor(losses),
                torch.tensor(ref_losses),
                atol=1e-5,
                rtol=0,
                msg=lambda m, s=strategy: f"{s}: {m}",
            )
            assert_close(
                drop_key_bias(params),
                drop_key_bias(ref_params),
                msg=lambda m, s=strategy: f"{s}: {m}",
            )
        memory[strategy] = runner.memory()
    return memory


# --- tests ---


@pytest.mark.timeout(180)
def test_colwise_rowwise_ffn_and_attention_match_single_forward_and_backward():
    checked = run_distributed(_layers_worker, 2)
    assert checked == [{"ffn": 4, "attn": 8}] * 2  # every weight and bias compared


@pytest.mark.timeout(180)
def test_tinygpt_logits_and_grads_match_and_replicated_grads_agree():
    replicated = run_distributed(_gpt_grads_worker, 2)
    assert {"pos_emb.weight", "norm.weight", "layers.0.attn_norm.weight"} <= set(replicated[0])
    # the embedding is split by vocabulary rows, the output layer by columns
    assert not {"tok_emb.weight", "head.weight"} & set(replicated[0])
    for name, grad in replicated[0].items():  # identical on both tp ranks, bit for bit
        assert (grad == replicated[1][name]).all(), name


@pytest.mark.timeout(180)
def test_tinygpt_20_adam_steps_with_grad_accum_match_single():
    ((local, whole), losses), (_, losses_1) = run_distributed(_gpt_train_worker, 2, 20, 2)
    assert local < whole  # each rank stores only its shards of the split layers
    assert losses == losses_1


@pytest.mark.timeout(180)
def test_dp2_x_tp2_matches_single_on_global_batch():
    """Plain dp (gradient all-reduce), FSDP2 ZeRO-2 and ZeRO-3 over dp, all x tp=2."""
    memory = run_distributed(_dp_tp_worker, 4, ("tp", "zero2", "zero3"), 20, 2)[0]
    assert memory["zero3"]["param_bytes"] < memory["tp"]["param_bytes"]
    assert memory["zero2"]["optim_bytes"] < memory["tp"]["optim_bytes"]


class _ThreeRankMesh:
    """Shape of a 1-D tp mesh of 3 ranks: apply_tp must refuse before touching it."""

    ndim = 1

    def size(self):
        return 3


def test_tp_must_divide_heads():
    model = make_gpt()
    with pytest.raises(ValueError, match="heads"):
        check_tp(model, 3)
    with pytest.raises(ValueError, match=r"degree 3 .* heads \(4\)"):
        apply_tp(model, _ThreeRankMesh())
    assert not any(hasattr(p, "full_tensor") for p in model.parameters())  # nothing split


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"precision": "fp16"}, "precision='fp16' needs backend='deepspeed'"),
        ({"pp": 2}, "strategy 'tp' does not split along pp"),
    ],
)
def test_what_the_tp_runner_cannot_run_is_refused_with_the_config(bad, match):
    """The runner trusts `TrainConfig.validate`, which every engine runs before it."""
    with pytest.raises(ValueError, match=match):
        train_cfg(**bad).validate(2)


def test_apply_tp_rejects_a_model_without_blocks():
    with pytest.raises(ValueError, match="Linear has no parallel_plan"):
        check_tp(nn.Linear(4, 4), 2)
