"""The pool's GPU policy: how many engines, and on which backend, for a machine's GPUs."""

import pytest

import nbpar
from nbpar import device

GLOO_NOTE = "CPU engines on gloo"


@pytest.mark.parametrize("n_gpus", [0, 1, 2, 8])
@pytest.mark.parametrize("n", [None, 1, 2, 8])
@pytest.mark.parametrize("backend", [None, "gloo", "nccl"])
def test_pool_plan_for_gpus_engines_and_backend(n_gpus, n, backend):
    wanted = n if n is not None else (n_gpus if n_gpus and backend != "gloo" else 2)
    if backend == "nccl" and wanted > n_gpus:
        with pytest.raises(ValueError, match=rf"use Pool\({n_gpus}\) or backend='gloo'"):
            device.pool_plan(n, backend, n_gpus)
        return
    engines, chosen, note = device.pool_plan(n, backend, n_gpus)
    assert engines == wanted
    if backend is not None:
        assert (chosen, note) == (backend, None)
    elif wanted <= n_gpus:
        assert (chosen, note) == ("nccl", None)
    else:
        assert chosen == "gloo"
        assert (note is not None and GLOO_NOTE in note) == (n_gpus > 0)


def test_one_gpu_machine_two_engines_is_gloo_with_one_line():
    n, backend, note = device.pool_plan(2, None, 1)
    assert (n, backend) == (2, "gloo")
    assert "\n" not in note and "1 GPU" in note


def test_no_n_on_a_gpu_machine_is_one_engine_per_gpu():
    assert device.pool_plan(None, None, 8)[:2] == (8, "nccl")
    assert device.pool_plan(None, None, 0)[:2] == (2, "gloo")


def test_other_launchers_keep_nccl_for_gpus_on_other_hosts():
    # the client's GPU count says nothing about engines a cluster launcher starts
    assert device.pool_plan(4, "nccl", 1, local=False)[:2] == (4, "nccl")


def test_pool_two_on_a_faked_one_gpu_machine_starts_gloo_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(device, "accelerator_count", lambda: 1)
    with nbpar.Pool(2) as pool:
        out = capsys.readouterr().out
        assert pool.backend == "gloo"
        assert out.count(GLOO_NOTE) == 1
        assert GLOO_NOTE in repr(pool)
        assert [s["device"] for s in pool.status()] == ["cpu", "cpu"]
        assert pool.run(lambda: __import__("torch.distributed").distributed.get_backend()) == [
            "gloo",
            "gloo",
        ]


def test_explicit_nccl_on_a_faked_one_gpu_machine_is_refused_before_start(monkeypatch):
    monkeypatch.setattr(device, "accelerator_count", lambda: 1)
    with pytest.raises(ValueError, match=r"use Pool\(1\) or backend='gloo'"):
        nbpar.Pool(2, backend="nccl")


@pytest.mark.parametrize(
    ("n_gpus", "flags", "engines"), [(0, [], 2), (8, [], 8), (8, ["--engines", "3"], 3)]
)
def test_cli_train_engines_default_is_one_per_gpu_or_two(monkeypatch, n_gpus, flags, engines):
    from nbpar.cli import build_parser, train_config

    monkeypatch.setattr(device, "accelerator_count", lambda: n_gpus)
    argv = ["train", "--strategy", "ddp", "--model", "tiny_gpt", "--steps", "1", *flags]
    assert train_config(build_parser().parse_args(argv))[1] == engines


def test_a_cpu_torch_on_a_gpu_machine_is_said_when_the_pool_starts(monkeypatch, capsys, tmp_path):
    """An NVIDIA device beside a torch built without CUDA: the pool runs on the CPU, and
    says why in its one line at start (and in its repr), not silently."""
    fake = tmp_path / "nvidia0"
    fake.write_text("")
    monkeypatch.setenv("NBPAR_NVIDIA_DEV", str(fake))
    if device.cpu_torch_on_a_gpu_machine() is None:
        pytest.fail("this torch has CUDA: the test needs a CPU build")
    with nbpar.Pool(1) as pool:
        out = capsys.readouterr().out
        assert pool.backend == "gloo"
        assert out.count("was built without CUDA") == 1 and "was built without CUDA" in repr(pool)
