"""Activation checkpointing, full and selective (Korthikanti et al. 2022): the same losses
as one process without it, on real gloo processes, and activation memory between none
and full; how a config, the CLI and the estimator name and model the kinds."""

from __future__ import annotations

import json

import pytest
import torch

from nbpar.cli import build_parser, main
from nbpar.config import GPTConfig, TrainConfig
from nbpar.errors import ConfigError
from nbpar.estimate import activation_bytes_per_layer, estimate_memory
from nbpar.train.loop import run_training
from tests.distributed import run_distributed

GPT = GPTConfig(seq_len=16, d_model=32, n_heads=4, n_layers=4)
BASE = dict(micro_batch=2, grad_accum=2, gpt=GPT)
KINDS = (False, "selective", "full")


def _kinds(rank, world):
    """Per kind: losses and activation bytes under tp 2 with sequence parallelism, with
    the fused attention kernel; then (3 steps) with the math one, which keeps the s x s
    scores that selective recomputation drops."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(kind, steps):
        cfg = TrainConfig(
            strategy="tp",
            sequence_parallel=True,
            activation_checkpointing=kind,
            steps=steps,
            **BASE,
        )
        res = run_training(cfg)
        return res["losses"], res["activation_bytes"]

    fused = {kind: run(kind, 10) for kind in KINDS}
    with sdpa_kernel(SDPBackend.MATH):
        math = {kind: run(kind, 3)[1] for kind in KINDS[:2]}
    return fused, math


@pytest.mark.timeout(420)
def test_full_and_selective_match_single_and_keep_less():
    want = run_training(TrainConfig(strategy="single", steps=10, **BASE))["losses"]
    (fused, math), _ = run_distributed(_kinds, 2, timeout=400)
    for losses, _ in fused.values():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), atol=1e-5, rtol=0)
    none, selective, full = (fused[kind][1] for kind in KINDS)
    # the fused kernel keeps no scores: selective drops only its softmax statistics
    assert none > selective > full
    # the math kernel keeps the (b, heads/tp, s, s) softmax of every layer: selective
    # recomputation drops at least that (Korthikanti et al.'s 5 a s^2 b term)
    scores = GPT.n_layers * 2 * (GPT.n_heads // 2) * GPT.seq_len**2 * 4
    assert math[False] - math["selective"] >= scores


def test_config_takes_the_kinds_and_keeps_old_configs():
    for kind in (False, True, "full", "selective"):
        cfg = TrainConfig(activation_checkpointing=kind).validate()
        assert TrainConfig.from_dict(cfg.to_dict()).activation_checkpointing == kind
    with pytest.raises(ConfigError, match="'full' or 'selective', got 'some'") as err:
        TrainConfig(activation_checkpointing="some").validate()
    assert err.value.fields == ("activation_checkpointing",)


def test_cli_flags():
    parse = build_parser().parse_args
    assert parse(["train", "--activation-checkpointing"]).activation_checkpointing == "full"
    args = parse(["train", "--activation-checkpointing", "selective", "--sequence-parallel"])
    assert (args.activation_checkpointing, args.sequence_parallel) == ("selective", True)
    assert parse(["train"]).activation_checkpointing is None  # a ds_config may decide


def test_estimator_models_korthikanti_per_kind():
    # s=8, b=2, h=16, a=4, 16-bit, tp=2 with sequence parallelism: s*b*h = 256
    none = activation_bytes_per_layer(2, 8, 16, 4, tp=2)
    selective = activation_bytes_per_layer(2, 8, 16, 4, tp=2, selective=True)
    assert (none, selective) == (256 * (34 + 10) / 2, 256 * 34 / 2)  # + 5 a s / h = 10
    spec = dict(batch=2, seq_len=8, hidden=16, layers=4, heads=4)

    def acts(recompute):
        est = estimate_memory(1e6, 2, "tp", precision="mixed", activations=spec | recompute)
        return est.per_rank_bytes["activations"]

    assert acts({}) == 4 * none
    assert acts({"recompute": "selective"}) == 4 * selective
    # full: each layer keeps its 16-bit input, split by sequence parallelism, and one
    # layer's activations are rebuilt at a time
    assert acts({"recompute": "full"}) == acts({"recompute": True}) == 4 * 256 * 2 / 2 + none


def test_cli_estimate_flags(capsys):
    shape = '{"batch": 2, "seq_len": 8, "hidden": 16, "layers": 4, "heads": 4}'
    argv = ["estimate", "--params", "1e6", "--world-size", "2", "--strategy", "tp"]
    argv += ["--precision", "mixed", "--activations", shape]
    sizes = {}
    for flags in (
        [],
        ["--sequence-parallel"],
        ["--sequence-parallel", "--activation-checkpointing"],
    ):
        assert main([*argv, *flags, "--json"]) == 0
        sizes[len(flags)] = json.loads(capsys.readouterr().out)["per_rank_bytes"]["activations"]
    assert sizes[0] > sizes[1] > sizes[2]  # without SP the norms' inputs stay whole
    assert main([*argv[:-2], "--activation-checkpointing", "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--activation-checkpointing changes the activations" in err[0]
