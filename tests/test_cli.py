"""The nbpar command line: one JSON object on stdout, exit 2 + one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def nbpar(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "nbpar", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--engines", "0"], "--engines"),
        (["train", "--strategy", "bogus"], "invalid choice: 'bogus'"),
        (["train", "--micro-batch", "-1"], "--micro-batch"),
        (["train", "--steps", "0"], "--steps"),
        (["train", "--strategy", "single", "--engines", "2"], "exactly one engine"),
        (["estimate", "--params", "-5", "--world-size", "8"], "--params"),
        (["estimate", "--params", "1e9"], "--world-size"),
        (["bench", "launch", "--engines", "x"], "--engines"),
        (["frobnicate"], "invalid choice"),
        (["train", "--resume-from", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["train", "--strategy", "hybrid", "--dp", "2", "--tp", "2", "--engines", "2"], "dp*tp*pp"),
        (
            ["train", "--strategy", "pipeline", "--schedule", "dualpipev", "--engines", "2"],
            "'dualpipev' needs at least one micro-batch per stage",
        ),
        (["train", "--strategy", "ep", "--model", "tiny_gpt"], "mixture-of-experts"),
        (
            ["train", "--strategy", "ep", "--model", "tiny_moe", "--engines", "2"]
            + ["--model-config", '{"n_experts": 3, "d_model": 16}'],
            "ep=2 must divide the 3 experts",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needle):
    out = nbpar(*args, "--json")
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_estimate_json_is_the_classic_table():
    out = nbpar(
        "estimate",
        "--params",
        "13e9",
        "--world-size",
        "1",
        "--strategy",
        "single",
        "--optimizer",
        "adam",
        "--precision",
        "fp32",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["per_rank_bytes"]["params"] == 52e9
    assert doc["per_rank_bytes"]["grads"] == 52e9
    assert doc["per_rank_bytes"]["optim"] == 104e9
    assert doc["per_rank_bytes"]["total"] == 208e9


def test_estimate_for_people_is_two_lines():
    out = nbpar("estimate", "--params", "13e9", "--world-size", "1", "--strategy", "single")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "single on 1 rank (dp 1 x tp 1 x pp 1), adam, fp32 precision, offload none: 13B parameters",
        "per rank: params 52.0 GB, grads 52.0 GB, optimizer 104.0 GB, total 208.0 GB",
    ]


def test_estimate_degrees_default_like_train():
    out = nbpar("estimate", "--params", "1e9", "--world-size", "4", "--strategy", "tp", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["per_rank_bytes"]["params"] == 1e9 * 4 / 4
    out = nbpar(
        "estimate",
        "--params",
        "1e9",
        "--world-size",
        "4",
        "--strategy",
        "hybrid",
        "--dp",
        "2",
        "--tp",
        "3",
        "--json",
    )
    assert out.returncode == 2 and "must equal" in out.stderr


@pytest.mark.timeout(300)
def test_bench_launch_measures_both_side_by_side():
    out = nbpar("bench", "launch", "--engines", "2", "--reps", "3", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for block in (doc, doc["baseline"]):
        assert set(block) >= {"ready_s", "cell_ms", "allreduce_ms"}
        # seconds to a usable pool, milliseconds per cell: a unit slip or a timer that
        # never ran lands far outside these bounds
        assert 0.5 < block["ready_s"] < 120
        assert 0.1 < block["cell_ms"] < 5_000 and 0.1 < block["allreduce_ms"] < 5_000
    # restart after a hung cell (spare engines warm) and with none prepared, in seconds
    assert 0.01 < doc["restart_s"] < 60 and 0.01 < doc["restart_cold_s"] < 120


@pytest.mark.timeout(300)
def test_train_for_people_shows_progress_and_a_table():
    out = nbpar("train", "--model", "simple_cnn", "--steps", "4", "--micro-batch", "4")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("ddp/torch simple_cnn: 4 steps, final loss ")
    # in flight, and of it what compute did not hide and the wait for a slower rank
    assert "communication in flight " in lines[0] and "(exposed " in lines[0]
    assert ", waiting for a slower rank " in lines[0]
    assert "blocked on communication " in lines[0] and "% of a normal step" in lines[0]
    assert lines[1].split() == [
        "rank",
        "params",
        "grads",
        "optimizer",
        "activations",
        "peak",
        "process",
        "ring/step",
    ]
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"]
    assert lines[4].startswith("timings ") and lines[4].endswith("memory and bytes are exact")
    # the bytes column named for what it is: counted at the c10d call, not on the wire
    assert lines[5].startswith("ring/step: bytes a rank sends under the ring algorithm, counted")
    assert "4/4" in out.stderr and "100%" in out.stderr  # the progress bar, on stderr
