"""scripts/install_torch.sh: a GPU machine never ends up with a CPU torch silently.

The script runs for real; the python it is given is a shell script standing in for
one (it reports a torch build and logs what pip was asked), the NVIDIA device a
temporary file named by NBPAR_NVIDIA_DEV, and PATH holds no nvidia-smi (a fake one
where a test puts it there)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "install_torch.sh"

# $STATE/torch holds the installed build's "version cuda" ("" cuda: a CPU build);
# pip installs the build in $STATE/wheel and logs its arguments to $STATE/pip.log
FAKE_PYTHON = """#!/bin/sh
case "$*" in
    "-c import torch") [ -f "$STATE/torch" ] ;;
    *torch.version.cuda*) read -r version cuda < "$STATE/torch"; echo "$cuda" ;;
    *torch.__version__*) read -r version cuda < "$STATE/torch"; echo "$version" ;;
    "-m pip install"*) echo "$*" >> "$STATE/pip.log"; read -r w < "$STATE/wheel"
        echo "$w" > "$STATE/torch" ;;
    *) exit 3 ;;
esac
"""


@pytest.fixture
def machine(tmp_path):
    """run(gpu=..., installed=..., wheel=..., **env) -> (process, pip's calls)."""
    state = tmp_path / "state"
    state.mkdir()
    bin_dir = tmp_path / "bin"  # PATH: the tools the script uses, no nvidia-smi
    bin_dir.mkdir()
    (bin_dir / "cat").symlink_to(shutil.which("cat"))
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    dev = tmp_path / "nvidia0"

    def run(*, gpu: bool, installed: str | None = None, wheel: str = "2.13.0+cpu ", **env):
        if gpu:
            dev.write_text("")
        if installed is not None:
            (state / "torch").write_text(installed)
        (state / "wheel").write_text(wheel)
        environ = {"PATH": str(bin_dir), "STATE": str(state), **env}
        environ["NBPAR_NVIDIA_DEV"] = str(dev)
        proc = subprocess.run(
            ["/bin/sh", str(SCRIPT), str(py)], env=environ, capture_output=True, text=True
        )
        log = state / "pip.log"
        return proc, log.read_text().splitlines() if log.exists() else []

    return run


def test_a_cpu_torch_on_a_gpu_machine_fails_loudly(machine):
    proc, pip = machine(gpu=True, installed="2.13.0+cpu ")
    assert proc.returncode != 0
    assert "has an NVIDIA GPU, but torch 2.13.0+cpu has no CUDA" in proc.stderr
    assert "--index-url https://pypi.org/simple" in proc.stderr  # the fix
    assert "NBPAR_ALLOW_CPU_TORCH=1" in proc.stderr
    assert pip == []


def test_a_cpu_wheel_installed_on_a_gpu_machine_fails_after_pip(machine):
    proc, pip = machine(gpu=True, wheel="2.13.0+cpu ", PIP_FIND_LINKS="/wheels")
    assert proc.returncode != 0 and "has no CUDA" in proc.stderr
    assert pip == ["-m pip install -q torch==2.13.0"]


def test_nvidia_smi_alone_also_marks_a_gpu_machine(machine, tmp_path):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    proc, _ = machine(gpu=False, installed="2.13.0+cpu ")
    assert proc.returncode != 0 and "has no CUDA" in proc.stderr


def test_allowing_the_cpu_build_keeps_the_warning(machine):
    proc, _ = machine(gpu=True, installed="2.13.0+cpu ", NBPAR_ALLOW_CPU_TORCH="1")
    assert proc.returncode == 0, proc.stderr
    assert "has no CUDA" in proc.stderr


def test_a_cuda_torch_on_a_gpu_machine_passes(machine):
    proc, pip = machine(gpu=True, installed="2.13.0 12.8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "torch already installed: 2.13.0\n" and proc.stderr == ""
    assert pip == []


def test_a_gpu_machine_installs_pypis_cuda_build(machine):
    proc, pip = machine(gpu=True, wheel="2.13.0 12.8", TORCH_INDEX_URL="https://cpu.example")
    assert proc.returncode == 0, proc.stderr
    assert pip == ["-m pip install -q torch==2.13.0"] and proc.stderr == ""


def test_a_cpu_machine_is_as_before(machine):
    proc, pip = machine(gpu=False, installed="2.13.0+cpu ")
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        0,
        "torch already installed: 2.13.0+cpu\n",
        "",
    )
    assert pip == []


@pytest.mark.parametrize(
    "env, args",
    [
        ({"TORCH_INDEX_URL": "https://cpu.example"}, "--index-url https://cpu.example "),
        ({"TORCH_VERSION": "2.12.0"}, ""),
    ],
)
def test_a_cpu_machine_installs_the_cpu_build_as_before(machine, env, args):
    proc, pip = machine(gpu=False, **env)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert pip == [f"-m pip install -q {args}torch=={env.get('TORCH_VERSION', '2.13.0')}"]
