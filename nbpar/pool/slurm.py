"""A Slurm pool's options and the engine batch script they make.

``Pool(n, launcher="slurm", slurm={...})`` takes what a cluster user sets on every
job: the partition, a time limit, an account, a QoS and any further ``#SBATCH``
lines. They are checked before anything is submitted, so a typo is one line in the
notebook, not a job that waits in the queue and fails there. `batch_template` turns
them into the script the engines' job runs: ipyparallel's own (every engine a task
of one job, started by ``srun``), with one GPU per task on ``backend="nccl"``.
"""

from __future__ import annotations

import re

#: slurm= keys, and what each becomes in the batch script
OPTIONS = {
    "partition": "--partition",
    "time": "--time",
    "account": "--account",
    "qos": "--qos",
    "extra": "further #SBATCH options, e.g. ['--nodes=2', '--exclusive']",
}
#: where ipyparallel's own config keeps the same settings (config=c still works)
FROM_CONFIG = {"partition": "queue", "time": "timelimit", "account": "account", "qos": "qos"}
#: sbatch options the pool sets itself: one line per engine task, its log, its env
POOL_SETS = {
    "--ntasks": "n",
    "-n": "n",
    "--output": "the pool's log file",
    "-o": "the pool's log file",
    "--job-name": "the pool's job name",
    "-J": "the pool's job name",
    "--export": "ALL (engines need the notebook's environment)",
}
#: sbatch options with a key of their own in slurm=
_KEYED = {
    **{flag: key for key, flag in OPTIONS.items() if key != "extra"},
    **{"-p": "partition", "-t": "time", "-A": "account", "-q": "qos"},
}
# Slurm's time formats: minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
_NAME = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")


def check_options(slurm, launcher: str, config=None) -> dict:
    """``slurm`` as checked options (partition, time, account, qos, extra), merged over
    what ``config``'s SlurmLauncher sets; ValueError in one line for anything off."""
    if slurm is None:
        slurm = {}
    elif launcher.lower() != "slurm":
        raise ValueError(f"slurm= options are for launcher='slurm', not {launcher!r}")
    if not isinstance(slurm, dict):
        raise ValueError(f"slurm= must be a dict like {{'partition': 'gpu'}}, got {slurm!r}")
    if slurm and own_template(config):
        raise ValueError(
            "slurm= options and a batch script of your own in config= "
            "(SlurmEngineSetLauncher.batch_template): put the options in your script"
        )
    unknown = sorted(set(slurm) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown slurm option(s) {', '.join(map(repr, unknown))}: "
            f"known are {', '.join(OPTIONS)}"
        )
    merged = {**_from_config(config), **{k: v for k, v in slurm.items() if v is not None}}
    out: dict = {}
    for key in ("partition", "account", "qos"):
        if key in merged and merged[key] != "":
            value = str(merged[key])
            if not _NAME.fullmatch(value):
                raise ValueError(
                    f"slurm {key} {value!r} is not a Slurm name (letters, digits, _ . + -; "
                    f"a comma between partitions)"
                )
            out[key] = value
    if merged.get("time") not in (None, ""):
        value = str(merged["time"])
        if not _TIME.fullmatch(value):
            raise ValueError(
                f"slurm time {value!r} is not a Slurm time limit: use minutes, 'HH:MM:SS' "
                f"or 'D-HH:MM:SS'"
            )
        out["time"] = value
    out["extra"] = _check_extra(merged.get("extra", []))
    return out


def _check_extra(extra) -> list[str]:
    if isinstance(extra, str) or not isinstance(extra, (list, tuple)):
        raise ValueError(f"slurm extra must be a list of sbatch options, got {extra!r}")
    lines = []
    for item in extra:
        text = str(item).strip()
        if text.startswith("#SBATCH"):
            text = text[len("#SBATCH") :].strip()
        if not text.startswith("-") or "\n" in text or "\r" in text:
            raise ValueError(
                f"slurm extra {item!r} is not one sbatch option: write it as on the "
                f"command line, e.g. '--nodes=2'"
            )
        flag = re.split(r"[=\s]", text, maxsplit=1)[0]
        if flag in POOL_SETS:
            raise ValueError(f"slurm extra {item!r}: the pool sets {flag} ({POOL_SETS[flag]})")
        if flag in _KEYED:
            raise ValueError(f"slurm extra {item!r}: pass it as slurm={{'{_KEYED[flag]}': ...}}")
        lines.append(text)
    return lines


def _from_config(config) -> dict:
    """partition, time, account, qos as ipyparallel's SlurmLauncher config sets them."""
    if config is None:
        return {}
    found = {}
    for section in ("BatchSystemLauncher", "SlurmLauncher", "SlurmEngineSetLauncher"):
        if section in config:
            for ours, theirs in FROM_CONFIG.items():
                if theirs in config[section] and config[section][theirs] not in ("", None):
                    found[ours] = config[section][theirs]
    return found


def own_template(config) -> bool:
    """Whether ``config`` brings a Slurm batch script of the user's own."""
    if config is None or "SlurmEngineSetLauncher" not in config:
        return False
    mine = config["SlurmEngineSetLauncher"]
    return "batch_template" in mine or "batch_template_file" in mine


def batch_template(options: dict, backend: str = "gloo") -> str:
    """The engines' batch script (an ipyparallel template: {n}, {output_file},
    {program_and_args}... are filled in when the job is submitted)."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    first, rest = SlurmEngineSetLauncher.default_template.default_value.split("\n", 1)
    lines = ["--ntasks={n}", "--output={output_file}"]
    lines += [f"{OPTIONS[k]}={options[k]}" for k in FROM_CONFIG if k in options]
    if backend == "nccl":
        lines.append("--gpus-per-task=1")  # each task then sees its GPU as device 0
    lines += [x.replace("{", "{{").replace("}", "}}") for x in options.get("extra", [])]
    return "\n".join([first, *(f"#SBATCH {line}" for line in lines), rest])


def check_submit(template: str, n: int, timeout: float = 30.0) -> None:
    """Ask Slurm whether it would take the engines' job (``sbatch --test-only``: nothing
    is submitted) and raise ValueError with its reason if not: an unknown partition, an
    account or QoS it refuses, a time over the partition's limit, more tasks than its
    nodes hold are one line before anything starts, not a failed job."""
    import os
    import subprocess
    import tempfile

    script = template.format(
        n=n, output_file=os.devnull, cluster_id="check", program_and_args="true"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(script)
    try:
        res = subprocess.run(
            ["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"sbatch --test-only did not answer within {timeout:g} s: is slurmctld up?"
        ) from None
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        said = [x.strip() for x in res.stderr.splitlines() if x.strip()]
        said = [x for x in said if not x.startswith("Try ")]  # 'Try "sbatch --help"'...
        errors = [x for x in said if "Warning" not in x] or said  # warnings only if all
        reason = "; ".join(x.removeprefix("sbatch: ").removeprefix("error: ") for x in errors[:2])
        raise ValueError(f"Slurm would not take the engines' job of {n} task(s): {reason}")


def job_state(cluster) -> str | None:
    """'the engines' Slurm job 12 is PENDING (Resources)', from squeue (None: no job)."""
    import subprocess

    for engines in cluster.engines.values():
        job = getattr(engines, "job_id", "")
        if not job:
            continue
        try:
            out = subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%T (%r)"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return f"the engines' Slurm job {job} is {out}" if out else None
    return None
