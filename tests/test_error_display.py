"""nbpar's own errors show as their one-line message in IPython and Jupyter, not under
the traceback of the internals that raised them (no pool: nothing starts)."""

from __future__ import annotations

import pytest
from IPython import get_ipython as running_shell
from IPython.testing.globalipapp import get_ipython

from nbpar.errors import ConfigError, DistTimeout, EngineDied, PoolError, RankError


@pytest.fixture
def shell():
    return get_ipython() or running_shell()


def shown(shell, capsys, code: str) -> list[str]:
    """What IPython prints for a cell that raises: its lines, blank ones dropped."""
    capsys.readouterr()
    shell.run_cell(code)
    out = capsys.readouterr()
    return [line for line in (out.out + out.err).splitlines() if line.strip()]


def test_a_refused_config_shows_its_sentence_first(shell, capsys):
    shell.user_ns["cells_config"] = dict(micro_batch=-1)
    lines = shown(
        shell,
        capsys,
        'class NoEngines:\n    n = 2\n    backend = "gloo"\n'
        "from nbpar.config import TrainConfig\nfrom nbpar.pool.run import start_run\n"
        "start_run(NoEngines(), TrainConfig(**cells_config))",
    )
    assert lines == ["ConfigError: micro_batch must be a positive integer, got -1"]


@pytest.mark.parametrize(
    "error",
    [
        PoolError("no pool is running: start one with nbpar.Pool(2)"),
        EngineDied("the engine of rank(s) [1] died", ranks=[1]),
        DistTimeout("ranks [0] did not finish in 2 s\n  rank 0: waiting in all_reduce", [0]),
        ConfigError("tp=3 must divide gpt.n_heads=4", fields=("tp", "gpt.n_heads")),
    ],
)
def test_nbpar_errors_render_as_their_message(error, shell, capsys):
    shell.user_ns["the_error"] = error
    lines = shown(shell, capsys, "raise the_error")
    message = str(error).splitlines()
    assert lines == [f"{type(error).__name__}: {message[0]}", *message[1:]]


def test_a_bug_keeps_its_traceback(shell, capsys):
    """Not nbpar's word: a plain error in the user's code still shows where it came from."""
    lines = shown(shell, capsys, "def f():\n    return 1 / 0\nf()")
    assert any("ZeroDivisionError" in line for line in lines)
    assert len(lines) > 3


def test_a_rank_error_shows_the_ranks_own_traceback():
    err = RankError({1: ("KeyError", "'lost'", ["Traceback ...", "KeyError: 'lost'"])})
    assert err._render_traceback_() == ["[rank 1] Traceback ...", "[rank 1] KeyError: 'lost'"]


def test_the_cli_says_a_failed_run_in_one_line(monkeypatch, capsys):
    from nbpar import cli

    def failing(args):
        raise RankError({0: ("RuntimeError", "boom", ["Traceback ...", "RuntimeError: boom"])})

    monkeypatch.setattr(cli, "cmd_train", failing)
    assert cli.main(["train", "--strategy", "single", "--json"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == ["nbpar: RankError: RuntimeError on rank 0: boom"]


def test_a_magic_used_wrongly_says_so_in_one_line(shell, capsys):
    shell.run_line_magic("load_ext", "nbpar")
    lines = shown(shell, capsys, "%dist frobnicate")
    assert lines == [
        "UsageError: %dist: unknown command 'frobnicate'; use status, start [N], restart, "
        "shutdown, doctor or debug N"
    ]
