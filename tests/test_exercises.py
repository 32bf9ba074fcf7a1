"""nbpar.exercises on real gloo processes: each reference answer passes, and each
typical wrong answer gets the hint that names what is wrong."""

from __future__ import annotations

import pytest

from tests import exercise_answers as answers
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(240)


def _check(rank, world, cases):
    """Every (exercise, answer) of ``cases`` checked on this rank: (passed, hint)s."""
    import nbpar.exercises as ex

    out = []
    for name, answer in cases:
        verdict = ex.check(name, getattr(answers, answer))
        out.append((verdict.passed, verdict.hint))
    return out


def _verdicts(world, cases):
    results = run_distributed(_check, world, cases)
    assert all(r == results[0] for r in results)  # every rank judges the same
    return dict(zip([a for _, a in cases], results[0], strict=True))


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_by_hand(world):
    got = _verdicts(
        world,
        [
            ("ring_all_reduce", "ring_all_reduce"),
            ("ring_all_reduce", "ring_without_all_gather"),
            ("ring_all_reduce", "ring_whole_tensor"),
            ("ring_all_reduce", "ring_with_all_reduce"),
            ("ring_all_reduce", "mean_all_reduce"),
            ("all_reduce_from_halves", "all_reduce_from_halves"),
            ("all_reduce_from_halves", "halves_without_gather"),
        ],
    )
    numel = 12 * world
    theory = 2 * (world - 1) * numel * 4 // world
    passed, hint = got["ring_all_reduce"]
    assert passed, hint
    assert hint.startswith(f"every rank holds the sum; each sent {theory} B")
    assert got["ring_without_all_gather"] == (
        False,
        f"only 1 of {world} chunks are the full sum on rank 0: a ring takes {world - 1} "
        f"reduce-scatter steps, then {world - 1} all-gather steps that pass the finished "
        f"chunks on",
    )
    passed, hint = got["ring_whole_tensor"]
    assert not passed
    if world == 2:  # one step with the whole tensor sends what a ring sends, in half the steps
        assert hint == (
            "rank 0 took 1 steps of one send and one receive: a ring of 2 takes "
            "2(N-1) = 2, each passing one chunk"
        )
    else:
        assert hint == (
            f"rank 0 sent {(world - 1) * numel * 4} B where a ring sends 2(N-1)/N of the "
            f"tensor, {theory} B: send one chunk (1/{world} of it) per step, not the whole "
            f"tensor"
        )
    assert got["ring_with_all_reduce"] == (
        False,
        "rank 0 called all_reduce: write the ring from send and recv only",
    )
    assert (
        got["mean_all_reduce"][1]
        == "rank 0 called all_reduce: write the ring from send and recv only"
    )
    assert got["all_reduce_from_halves"][0], got["all_reduce_from_halves"]
    assert f"what one all_reduce moves ({theory} B)" in got["all_reduce_from_halves"][1]
    assert got["halves_without_gather"] == (False, "rank 0 never called all_gather")


def test_a_sampler_by_hand():
    got = _verdicts(
        3,
        [
            ("shard_indices", "shard_indices"),
            ("shard_indices", "shard_indices_no_epoch"),
            ("shard_indices", "shard_indices_same_for_all"),
            ("shard_indices", "shard_indices_unpadded"),
        ],
    )
    assert got["shard_indices"][0], got["shard_indices"]
    assert got["shard_indices_no_epoch"] == (
        False,
        "epoch 1 repeated epoch 0's order on rank 0: did you call set_epoch (seed the "
        "shuffle with seed + epoch)?",
    )
    assert got["shard_indices_same_for_all"] == (
        False,
        "rank 1 read the same samples as rank 0: did each rank get its own shard (every "
        "3th index, starting at its rank)?",
    )
    assert got["shard_indices_unpadded"][1].startswith(
        "ranks read different numbers of samples (3, 4): pad to ceil(n / world) = 4 each"
    )


def test_ddp_by_hand():
    got = _verdicts(
        2,
        [
            ("average_gradients", "average_gradients"),
            ("average_gradients", "sum_gradients"),
            ("average_gradients", "no_communication"),
            ("average_gradients", "average_gradients_twice"),
        ],
    )
    passed, hint = got["average_gradients"]
    assert passed, hint
    assert hint.startswith("gradients equal DDP's on every rank; you called all_reduce 4 time(s)")
    assert got["sum_gradients"] == (
        False,
        "the gradients are 2x DDP's: all_reduce sums, so divide by the world size (2)",
    )
    assert got["no_communication"] == (
        False,
        "rank 0's gradients are still its own: all_reduce every parameter's .grad",
    )
    passed, hint = got["average_gradients_twice"]
    assert not passed
    assert hint.startswith("you called all_reduce 8 times and sent 2.0x the bytes DDP sends")


def test_a_check_outside_the_pool_or_of_no_exercise_says_so():
    import nbpar.exercises as ex

    with pytest.raises(ValueError, match=r"no exercise 'ring'; there are: ring_all_reduce"):
        ex.check("ring", answers.ring_all_reduce)
    with pytest.raises(RuntimeError, match=r"check them in a %%dist cell"):
        ex.check("ring_all_reduce", answers.ring_all_reduce)


def test_in_a_dist_cell_rank_0_says_the_verdict_once(pool):
    res = pool.execute(
        "import torch, torch.distributed as dist, nbpar.exercises\n"
        "def average_gradients(model):\n"
        "    for p in model.parameters():\n"
        "        dist.all_reduce(p.grad)\n"
        "v = nbpar.exercises.check('average_gradients', average_gradients)\n"
        "print(bool(v))"
    )
    lines = res.text().splitlines()
    assert lines[0] == (
        "[rank 0] DDP by hand: not yet: the gradients are 2x DDP's: all_reduce sums, "
        "so divide by the world size (2)"
    )
    assert lines[1:] == ["[rank 0] False", "[rank 1] False"]


def test_accumulation_tensor_parallel_and_mesh():
    got = _verdicts(
        4,
        [
            ("accumulate", "accumulate"),
            ("accumulate", "accumulate_without_no_sync"),
            ("accumulate", "accumulate_undivided"),
            ("tp_mlp", "tp_mlp"),
            ("tp_mlp", "tp_mlp_no_all_reduce"),
            ("tp_mlp", "tp_mlp_reduce_twice"),
            ("mesh", "mesh"),
            ("mesh", "mesh_swapped"),
        ],
    )
    assert got["accumulate"][0], got["accumulate"]
    assert got["accumulate_without_no_sync"] == (
        False,
        "you all-reduced 4 times where one step does 1: 4x the bytes; run all but the "
        "last micro-batch inside model.no_sync()",
    )
    assert got["accumulate_undivided"][1].startswith("the gradients are 4x one step's")
    assert got["tp_mlp"] == (
        True,
        "every rank's output equals the unsplit MLP's, with one all_reduce of the 4x6 "
        "output (144 B) and none between the two linears",
    )
    assert got["tp_mlp_no_all_reduce"][1].startswith("rank 0 returns its partial sum")
    assert got["tp_mlp_reduce_twice"][1] == (
        "rank 0 called all_reduce 2 times, moving 288 B: one all_reduce of the output "
        "(4x6, 144 B) is all a column + row pair needs"
    )
    assert got["mesh"] == (
        True,
        "2 x 2: tp groups [(0, 1), (2, 3)] (consecutive ranks), dp groups [(0, 2), (1, 3)]",
    )
    assert got["mesh_swapped"][1].startswith("the mesh is [2, 2] named ['tp', 'dp']")


def test_zero_by_hand():
    got = _verdicts(
        2,
        [
            ("zero1_step", "zero1_step"),
            ("zero1_step", "zero1_whole_adam"),
            ("zero1_step", "zero1_no_gather"),
            ("fully_shard", "fully_shard_each"),
            ("fully_shard", "fully_shard_root_only"),
        ],
    )
    assert got["zero1_step"] == (
        True,
        "one Adam step equal to the unsharded one; each rank kept 192 B of Adam state "
        "(1/2 of it) and gathered 96 B of parameters",
    )
    assert got["zero1_whole_adam"][1].startswith(
        "rank 0's Adam holds 384 B of state: ZeRO-1 keeps only its slice's, 2 x 24 x 4 = 192 B"
    )
    assert got["zero1_no_gather"][1] == (
        "24 of rank 0's 48 parameters did not change: each rank updates only its slice, "
        "so all_gather the updated slices"
    )
    passed, hint = got["fully_shard_each"]
    assert passed, hint
    assert hint.startswith("3 layer units and the root; each rank holds ")
    assert got["fully_shard_root_only"][1].startswith(
        "0, 2, 4 are not an FSDP unit of its own: fully_shard each layer before the model"
    )


def test_sizing_by_hand_needs_no_pool(capsys):
    import nbpar.exercises as ex

    assert ex.check("memory", answers.memory)
    assert capsys.readouterr().out.startswith("model memory by hand: passed: 2 + 2 + 12 = 16 B")
    fp32 = ex.check("memory", answers.memory_fp32)
    assert fp32.hint.startswith("that is fp32 training's 4 + 4 + 8 B")
    flat = ex.check("memory", answers.memory_unsharded)
    assert flat.hint == (
        "1e+09 parameters, 8 ranks, ZeRO stage 1: your optim is 1.2e+10 B a rank, the ZeRO "
        "paper's 1.5e+09 B (stage 1 splits it over the 8 ranks)"
    )
    time = ex.check("training_time", answers.training_time)
    assert time and time.hint.endswith(
        "take 11.1 days on one A100 at 40% MFU, and 28 days are 50B tokens"
    )
    assert ex.check("training_time", answers.training_time_forward_only).hint.startswith(
        "you counted the forward pass only (2 N D)"
    )


def _check_gpipe(rank, world, answer):
    import nbpar.exercises as ex

    v = ex.check("gpipe", getattr(answers, answer), timeout=3)
    return v.passed, v.hint


@pytest.mark.parametrize(
    "answer, passed, hint",
    [
        ("gpipe", True, "both stages' gradients equal one process's; 4 micro-batches each way"),
        ("gpipe_undivided", False, "stage 0's gradients are 4x one step's: divide each"),
        (
            "gpipe_no_grads_back",
            False,
            "stage 1 made 4 sends and receives where GPipe makes 2m = 8 (4 activations one "
            "way, 4 gradients back): does it receive every micro-batch, and send back each",
        ),
        (
            "gpipe_never_receives",  # both stages then wait in their first send
            False,
            "a send or recv waited 3 s with nobody answering: does stage 1 receive every",
        ),
    ],
)
def test_a_two_stage_gpipe(answer, passed, hint):
    results = run_distributed(_check_gpipe, 2, answer)
    assert results[0] == results[1]
    assert results[0][0] is passed and results[0][1].startswith(hint), results[0]
