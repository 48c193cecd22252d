"""``python -m MODULE ARGS`` for the tests, without paying each run's imports again.

A one-process ``olmo-tda train`` of the tiny OLMo spends ~7 of its ~10 s importing OLMo (which pulls in
torchmetrics, transformers, datasets, scipy); the suite runs dozens of them. Here a long-lived process
(one per preload set) imports those modules once, does no torch compute, and forks one child per run.
The child is set up as a fresh ``python -m`` would be: its own environment, working directory, argv,
stdin from /dev/null, stdout/stderr captured, the module executed anew as ``__main__`` (it is not in
the preload), torch's thread count and numpy's global seed as a new process has them, and at the end
non-daemon threads joined and atexit handlers run before the exit status is returned.

Variables read while importing (``PYTHONPATH`` and the like) cannot differ between the preloaded process
and a run: such a run, and every run when ``OLMO_TDA_TESTS_COLD=1``, goes to a real subprocess instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# What each entry point imports lazily or at the top, minus the module itself (it must run anew).
PRELOAD = {
    "olmo_tda.cli": ("olmo_tda.integrations.olmo_train", "olmo_tda.integrations.olmo_query"),
    "olmo_tda.integrations.deepspeed_pretrain": ("deepspeed", "olmo_tda.integrations.deepspeed",
                                                 "olmo_tda.integrations.olmo"),
}
# Read when the preloaded modules are imported: a run that sets them differently is run cold.
_STARTUP_VARS = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE",
                 "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "DS_BUILD_OPS")


def run_module(module: str, argv: list[str], *, env: dict[str, str], cwd: Path | str,
               timeout: float) -> subprocess.CompletedProcess:
    """As ``subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
    timeout=timeout, env=env, cwd=cwd)`` (which it is, for a module without a preload set, for a run
    whose start-up variables differ from the preloaded process's, or with ``OLMO_TDA_TESTS_COLD=1``)."""
    cmd = [sys.executable, "-m", module, *argv]
    if module not in PRELOAD or os.environ.get("OLMO_TDA_TESTS_COLD") == "1":
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    zygote = _zygote(module)
    if any(env.get(k) != zygote.env.get(k) for k in _STARTUP_VARS):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    return zygote.run(cmd, module, argv, env=env, cwd=cwd, timeout=timeout)


class _Zygote:
    def __init__(self, preload: tuple[str, ...]):
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline")
        self.tmp = Path(tempfile.mkdtemp(prefix="olmo_tda_warm_"))
        self.log = open(self.tmp / "zygote.log", "w+b")     # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=HERE)
        ready = self._reply(timeout=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the preloading process did not start: {ready}")

    def _reply(self, timeout: float | None) -> dict:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            return {"timeout": True}
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the preloading process ended (status {self.proc.wait()}): "
                               f"{self.log.read().decode(errors='replace')[-4000:]}")
        return json.loads(line)

    def run(self, cmd, module, argv, *, env, cwd, timeout) -> subprocess.CompletedProcess:
        out, err = self.tmp / "stdout", self.tmp / "stderr"
        request = {"module": module, "argv": list(argv), "env": dict(env), "cwd": str(cwd),
                   "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._reply(timeout=60)["pid"]
        done = self._reply(timeout=timeout)
        if done.get("timeout"):
            os.kill(pid, signal.SIGKILL)
            self._reply(timeout=60)
            raise subprocess.TimeoutExpired(cmd, timeout, output=_text(out), stderr=_text(err))
        return subprocess.CompletedProcess(cmd, done["rc"], _text(out), _text(err))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _text(path: Path) -> str:
    return path.read_bytes().decode(errors="replace") if path.exists() else ""


_ZYGOTES: dict[str, _Zygote] = {}


def _zygote(module: str) -> _Zygote:
    zygote = _ZYGOTES.get(module)
    if zygote is None or zygote.proc.poll() is not None:
        zygote = _ZYGOTES[module] = _Zygote(PRELOAD[module])
    return zygote


@atexit.register
def _close_all() -> None:
    for zygote in _ZYGOTES.values():
        zygote.close()


# ---- the preloading process ----------------------------------------------------------------------------

def _serve(preload: list[str]) -> None:
    import importlib

    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)                       # this process's own prints go to its log
    for name in preload:
        importlib.import_module(name)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(request, devnull)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _child(request: dict, devnull: int) -> None:
    """Run the request as ``python -m`` would and exit with its status; never returns."""
    import runpy
    import threading

    code = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import numpy as np
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        np.random.seed()                # a new process seeds numpy's global state afresh
        module = request["module"]
        sys.modules.pop(module, None)
        sys.argv = [module, *request["argv"]]
        sys.path[0] = os.getcwd()       # as `python -m` puts the working directory first
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code & 0xFF
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:           # noqa: BLE001 - reported as the interpreter would: through
            sys.excepthook(*sys.exc_info())     # the hook the run may have installed (OLMo does)
            code = 1
        threading._shutdown()           # as the interpreter does at exit: join non-daemon threads,
        atexit._run_exitfuncs()         # then run the atexit handlers
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1:])
