"""A simulated pipeline runs two micro-batches per stage and one stage per group of alike
stages, and composes the rest (`nbpar.simulate.segments`): its figures equal running
every micro-batch on every stage, to the byte; the 405B layout's options reach the CLI."""

from __future__ import annotations

import json

import pytest

import nbpar
from nbpar.simulate.roles import stage_roles
from nbpar.simulate.run import prepare

GPT = nbpar.GPTConfig(d_model=64, n_heads=4, n_layers=7, seq_len=16)
KEYS = (
    "rank",
    "stands_for",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "activation_bytes",
    "peak_bytes",
    "comm_buffer_bytes",
    "temp_bytes",
    "comm_bytes",
    "comm_bytes_by_op",
)
LAYOUTS = [
    # 7 layers on 4 stages: 2, 2, 2, 1, so stages 1 and 2 are one role; 1F1B
    (4, dict(strategy="pipeline", grad_accum=6)),
    # 3-D, sequence parallel, full recomputation, data parallel by all-reduce
    (
        12,
        dict(
            strategy="hybrid",
            dp=2,
            tp=2,
            pp=3,
            grad_accum=5,
            sequence_parallel=True,
            activation_checkpointing="full",
        ),
    ),
    # GPipe, selective recomputation, bf16 autocast
    (
        6,
        dict(
            strategy="hybrid",
            tp=2,
            pp=3,
            grad_accum=4,
            schedule="gpipe",
            activation_checkpointing="selective",
            precision="bf16",
        ),
    ),
]


@pytest.mark.spawn  # nbpar.simulate runs pipeline layouts in spawned processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, kw", LAYOUTS)
def test_composed_steps_equal_every_micro_batch(world, kw):
    cfg = nbpar.TrainConfig(gpt=GPT, micro_batch=2, **kw)
    composed = nbpar.simulate(cfg, world)
    every = nbpar.simulate(cfg, world, compose=False)
    assert len(composed["ranks"]) == len(every["ranks"]) == 4 if world == 4 else 3
    for a, b in zip(composed["ranks"], every["ranks"]):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}


def test_alike_stages_share_a_simulated_rank():
    cfg, dims = prepare(nbpar.TrainConfig(strategy="pipeline", gpt=GPT, grad_accum=6), 4)
    assert stage_roles(cfg, dims) == [(0, [0]), (1, [1, 2]), (3, [3])]
    assert stage_roles(cfg, dims, compose=False) == [(r, None) for r in range(4)]
    fsdp, dims = prepare(
        nbpar.TrainConfig(strategy="hybrid", dp=2, pp=2, fsdp_reshard=True, grad_accum=2, gpt=GPT),
        4,
    )
    assert stage_roles(fsdp, dims) == [(0, None), (2, None)]  # FSDP2: every micro-batch


def test_simulate_cli_takes_sequence_parallel_and_checkpointing(capsys):
    from nbpar.cli import main

    argv = ["simulate", "--strategy", "tp", "--world-size", "2", "--model-config"]
    argv += [json.dumps({"d_model": 32, "n_layers": 2}), "--micro-batch", "2"]
    out = {}
    for flags in ([], ["--sequence-parallel", "--activation-checkpointing", "selective"]):
        assert main([*argv, *flags, "--json"]) == 0
        out[len(flags)] = json.loads(capsys.readouterr().out)
    cfg = out[3]["config"]
    assert (cfg["sequence_parallel"], cfg["activation_checkpointing"]) == (True, "selective")
    assert out[3]["ranks"][0]["activation_bytes"] < out[0]["ranks"][0]["activation_bytes"]
    assert main([*argv, "--sequence-parallel", "--activation-checkpointing"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "(dp 1 x tp 2 x pp 1), sequence parallel, full activation checkpointing" in head
    # a device too small: the last line says which ranks and what their peak was made of
    assert main([*argv, "--device-memory", "0.000001"]) == 0
    why = capsys.readouterr().out.splitlines()[-1]
    assert why.startswith("ranks 0-1 peak at ") and "model states " in why
    assert "activations " in why and "temporaries " in why
