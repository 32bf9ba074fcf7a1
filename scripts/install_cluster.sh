#!/bin/sh
# Install what the tests' private clusters need: Slurm (Debian slurm-wlm: slurmctld,
# slurmd, sbatch, srun) with munge for tests/test_slurm.py, and an ssh server and
# client for the SSH launcher's test across network namespaces (tests/test_ssh.py).
# Nothing is started or configured here: each test starts its own daemons. Idempotent;
# where it cannot install (not root and no sudo), it says so and those tests skip.
set -eu
NEED=""
for cmd in slurmctld slurmd sbatch munged sshd ssh ssh-keygen; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || NEED="$NEED $cmd"
done
if [ -z "$NEED" ]; then
    echo "cluster tools already installed: $(slurmd -V 2>/dev/null)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo"
    else
        echo "not installing Slurm and an ssh server (missing:$NEED): needs root;" \
             "tests/test_slurm.py and tests/test_ssh.py will skip"
        exit 0
    fi
fi
PKGS="slurm-wlm munge openssh-server openssh-client"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $PKGS >/dev/null || {
    $SUDO apt-get update -q >/dev/null && \
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $PKGS >/dev/null; }
# the packages start system daemons where an init system runs; the tests use their own
echo "installed: $(slurmd -V 2>/dev/null), $(ssh -V 2>&1)"
