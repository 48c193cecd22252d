"""``python -m MODULE ARGS`` (or ``python SCRIPT.py ARGS``) for the tests, without paying each run's
imports again.

A one-process ``olmo-tda train`` of the tiny OLMo spends ~7 of its ~9 s importing OLMo (which pulls in
torchmetrics, transformers, datasets, scipy); the suite runs dozens of them. Here a long-lived process
(one per preload set) imports those modules once, does no torch compute, and forks one child per run.
The child is set up as a fresh ``python -m`` would be: its own environment, working directory, argv,
stdin from /dev/null, stdout/stderr captured, the module executed anew as ``__main__`` (it is not in the preload), torch's thread
count and the global seeds of torch and numpy as a new process has them. It then ends as an interpreter
does: its exit status, or its uncaught exception, leaves through the interpreter's own shutdown (threads
joined, atexit handlers, objects finalized).

What a fork cannot give a run: a string hash seed of its own (every warm run shares the preloaded
process's), what the preloaded imports print (a warning DeepSpeed prints when imported is in the
preloaded process's log, not in any run's output), and variables read while importing (``PYTHONPATH``, thread counts of the math libraries,
...). A run whose start-up variables differ from the preloaded process's, every run where torch is a
CUDA build (a fork after CUDA was queried cannot use it), and every run when ``OLMO_TDA_TESTS_COLD=1``
goes to a real subprocess instead.
"""

from __future__ import annotations

import atexit
import itertools
import json
import locale
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
    str(HERE.parent / "examples" / "deepspeed_pretrain.py"): ("deepspeed", "olmo_tda.integrations.deepspeed",
                                                            "olmo_tda.integrations.olmo"),
}
# Read by the interpreter or a library while the preloaded modules are imported: a run that sets any
# of these differently from the preloaded process is run cold.
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH_", "CUDA_", "DS_", "DEEPSPEED_",
                     "HF_", "TRANSFORMERS_")


def run_module(module: str, argv: list[str], *, env: dict[str, str], cwd: Path | str,
               timeout: float) -> subprocess.CompletedProcess:
    """As ``subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
    timeout=timeout, env=env, cwd=cwd)`` (which it is, for a module without a preload set, for a run
    whose start-up variables differ from the preloaded process's, with a CUDA build of torch, or with
    ``OLMO_TDA_TESTS_COLD=1``); a ``module`` ending in ``.py`` is a script path, run as ``python
    SCRIPT``."""
    import torch

    cmd = [sys.executable, module, *argv] if module.endswith(".py") else [sys.executable, "-m", module, *argv]
    if module not in PRELOAD or os.environ.get("OLMO_TDA_TESTS_COLD") == "1" or torch.version.cuda is not None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    zygote = _zygote(module)
    if _startup_vars(env) != _startup_vars(zygote.env):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    try:
        return zygote.run(cmd, module, argv, env=env, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise
    except BaseException:
        # left mid-run (an interrupt, a broken reply): the replies that follow would belong to this
        # run, so this preloaded process is not used again
        zygote.close(kill=True)
        _ZYGOTES.pop(module, None)
        raise


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES)}


class _Zygote:
    def __init__(self, preload: tuple[str, ...]):
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline")
        self.tmp = Path(tempfile.mkdtemp(prefix="olmo_tda_warm_"))
        self.log = open(self.tmp / "zygote.log", "w+b")     # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=self.env,
                                     cwd=HERE)
        self.serial = itertools.count()
        ready = self._reply(timeout=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the preloading process did not start: {ready}")

    def _reply(self, timeout: float) -> dict:
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return {"timeout": True}
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"the preloading process ended (status {self.proc.wait()}): "
                               f"{self.log.read().decode(errors='replace')[-4000:]}")
        return json.loads(line)

    def _expect(self, serial: int, key: str, timeout: float) -> dict:
        reply = self._reply(timeout)
        if not reply.get("timeout") and (reply.get("serial") != serial or key not in reply):
            raise RuntimeError(f"the preloading process answered {reply}, not the {key} of run {serial}")
        return reply

    def run(self, cmd, module, argv, *, env, cwd, timeout) -> subprocess.CompletedProcess:
        serial = next(self.serial)
        out, err = self.tmp / f"{serial}.out", self.tmp / f"{serial}.err"
        request = {"serial": serial, "module": module, "argv": list(argv), "env": dict(env), "cwd": str(cwd),
                   "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        started = self._expect(serial, "pid", timeout=60)
        if started.get("timeout"):
            raise RuntimeError("the preloading process did not start the run within 60 s")
        done = self._expect(serial, "rc", timeout=timeout)
        if done.get("timeout"):
            try:
                os.kill(started["pid"], signal.SIGKILL)
            except ProcessLookupError:          # it ended meanwhile
                pass
            if self._expect(serial, "rc", timeout=60).get("timeout"):
                raise RuntimeError(f"run {serial} was killed after its timeout but never reaped")
            raise subprocess.TimeoutExpired(cmd, timeout, output=_text(out), stderr=_text(err))
        return subprocess.CompletedProcess(cmd, done["rc"], _text(out), _text(err))

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _text(path: Path) -> str:
    """A run's output as ``subprocess.run(text=True)`` gives it: decoded as the locale says, universal
    newlines."""
    data = path.read_bytes() if path.exists() else b""
    path.unlink(missing_ok=True)
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


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
    log = os.dup(2)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log, 1)                     # this process's own prints (its imports') go to its log
    os.close(log)
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
            _child(request)             # leaves by SystemExit or the run's own exception, never back here
        serial = request["serial"]
        replies.write(json.dumps({"serial": serial, "pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"serial": serial, "rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _redirect(out: Path, err: Path) -> None:
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)


def _child(request: dict) -> None:
    """Run the request as ``python -m`` would. Its end is the interpreter's: the SystemExit raised here
    (or the run's own, or its uncaught exception) propagates out of the serving loop, so the status,
    the report of an exception, thread joins, atexit handlers and finalizers are Python's own."""
    import runpy

    _redirect(Path(request["stdout"]), Path(request["stderr"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import numpy as np
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    torch.seed()                        # a new process seeds torch's and numpy's global generators afresh
    np.random.seed()
    module = request["module"]
    sys.argv = [module, *request["argv"]]
    if module.endswith(".py"):          # a script: `python SCRIPT` puts the script's folder first
        sys.path[0] = os.path.dirname(os.path.abspath(module))
        runpy.run_path(module, run_name="__main__")
        raise SystemExit(0)
    sys.modules.pop(module, None)
    sys.path[0] = os.getcwd()           # as `python -m` puts the working directory first
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)


if __name__ == "__main__":
    _serve(sys.argv[1:])
