"""One venv per peer, made the same way: CPU torch 2.13.0 first, then the peer from PyPI, pinned.

    python benchmarks/peers/venvs.py [--venvs DIR] [NAME ...]    # create or check, print status

A peer that does not install records why, in ``DIR/NAME.json``, and the benchmark reports that
reason in its row. torchvision is never installed. It breaks this CPU torch's import, and two peers
(kronfluence, logix-ai) would pull it in or a numpy this interpreter cannot build, so those two
install with ``--no-deps`` and their runtime dependencies listed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("OLMO_TDA_PEER_VENVS", Path.home() / ".cache" / "olmo_tda" / "peer_venvs"))
TORCH = "torch==2.13.0"

# name -> (import module, distribution, pip install steps after torch)
PEERS: dict[str, tuple[str, str, list[list[str]]]] = {
    "dattri_llm": ("dattri_llm", "dattri-llm", [["dattri-llm==0.1.0", "dattri==0.3.0", TORCH]]),
    # kronfluence requires torchvision in its metadata but never imports it
    "kronfluence": ("kronfluence", "kronfluence", [
        ["--no-deps", "kronfluence==1.0.1"],
        [TORCH, "accelerate>=0.31.0", "einops>=0.8.0", "einconv>=0.1.0", "opt-einsum>=3.3.0",
         "safetensors>=0.4.2", "tqdm>=4.66.4"]]),
    "dattri": ("dattri", "dattri", [["dattri==0.3.0", TORCH]]),
    "traker": ("trak", "traker", [["traker==0.3.2", TORCH]]),
    # logix-ai 0.1.1 declares Python < 3.11 but runs on 3.11; its newest numpy needs 3.12
    "logix": ("logix", "logix-ai", [
        ["--no-deps", "--ignore-requires-python", "logix-ai==0.1.1"],
        [TORCH, "numpy==2.4.6", "einops", "pyyaml", "tqdm"]]),
}


# The OLMo workload (``--arch olmo``) runs ai2-olmo's model inside every peer's venv. OLMo's package
# imports its cloud-I/O helpers at module level, so these come with it; each is pinned to the version
# in this (the orchestrator's) environment. They go into one folder of their own, never into a peer's
# venv: the workload appends it to the end of sys.path, so the peer's own packages keep priority.
OLMO_DIST = "ai2-olmo"
OLMO_IMPORT_DEPS = ["boto3", "datasets", "requests", "rich", "cached_path", "importlib_resources", "tokenizers",
                    "omegaconf", "google-cloud-storage"]


def olmo_lib(root: Path = DEFAULT_DIR, *, log=print, python: Path | None = None) -> dict:
    """``{"ok": True, "path"}``: a folder from which ``python`` (a peer's interpreter) imports
    ``olmo.model``, created once under ``root``; or ``{"ok": False, "reason"}``."""
    import importlib.metadata as md

    lib = root / "_olmo_lib"
    try:
        pins = [f"{OLMO_DIST}=={md.version(OLMO_DIST)}", *(f"{d}=={md.version(d)}" for d in OLMO_IMPORT_DEPS)]
    except md.PackageNotFoundError as exc:
        return {"ok": False, "reason": f"this environment lacks {exc} (pip install -e '.[dev]')"}
    stamp = lib / "pins.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == pins):
        log(f"[peers] installing {pins[0]} and its import-time dependencies into {lib}")
        root.mkdir(parents=True, exist_ok=True)
        logfile = root / "_olmo_lib.install.log"
        with open(logfile, "w") as out:
            failed = None
            # ai2-olmo without its declared dependencies (they include torch: never a second one)
            for args in (["--no-deps", pins[0]], pins[1:]):
                cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--upgrade",
                       "--target", str(lib), *args]
                out.write("$ " + " ".join(cmd) + "\n")
                out.flush()
                if failed is None and subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                    failed = "pip install --target " + " ".join(args)
        if failed:
            tail = logfile.read_text().strip().splitlines()[-3:]
            return {"ok": False, "reason": f"{failed} failed: {' | '.join(tail)}", "log": str(logfile)}
        stamp.write_text(json.dumps(pins))
    code = ("import sys; sys.path.append(sys.argv[1]); import torch; from olmo.model import OLMo; "
            "assert torch.__file__.startswith(sys.prefix), torch.__file__")
    r = subprocess.run([str(python or sys.executable), "-c", code, str(lib)], capture_output=True, text=True)
    if r.returncode:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode)
        return {"ok": False, "reason": f"olmo.model does not import from {lib}: {last}"}
    return {"ok": True, "path": str(lib)}


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _probe(py: Path, module: str, dist: str, *, pinned_torch: bool = True) -> dict:
    code = ("import importlib.metadata as m, importlib.util as u, json, torch, {mod};"
            "print(json.dumps({{'version': m.version('{dist}'), 'torch': torch.__version__,"
            " 'torchvision': u.find_spec('torchvision') is not None}}))").format(mod=module, dist=dist)
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        return {"ok": False, "reason": f"import {module} failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"}
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if pinned_torch and info["torchvision"]:      # a CUDA image's own torchvision matches its torch
        return {"ok": False, "reason": "torchvision got installed (it breaks the CPU torch import)", **info}
    if pinned_torch and not info["torch"].startswith("2.13.0"):
        return {"ok": False, "reason": f"pip moved torch to {info['torch']}", **info}
    return {"ok": True, **info}


def here(name: str) -> dict:
    """Peer ``name`` as this interpreter imports it (no venv; e.g. a GPU machine without a package
    index, its wheels installed beside this checkout): ``{"ok", "python", "version", ...}`` or
    ``{"ok": False, "reason"}``. Any torch (the machine's own CUDA build is the point there), and
    torchvision beside it is no harm there."""
    module, dist, _ = PEERS[name]
    status = _probe(Path(sys.executable), module, dist, pinned_torch=False)
    return {**status, "python": sys.executable} if status["ok"] else status


def ensure(name: str, root: Path = DEFAULT_DIR, *, log=print) -> dict:
    """``{"ok", "python", "version", ...}`` or ``{"ok": False, "reason"}`` for peer ``name``:
    an existing working venv is reused, otherwise it is created and installed."""
    module, dist, steps = PEERS[name]
    venv = root / name
    py = python_of(venv)
    status_file = root / f"{name}.json"
    if py.exists():
        status = _probe(py, module, dist)
        if status["ok"]:
            status["python"] = str(py)
            status_file.write_text(json.dumps(status))
            return status
    root.mkdir(parents=True, exist_ok=True)
    log(f"[peers] creating venv {venv} for {dist}")
    logfile = root / f"{name}.install.log"
    with open(logfile, "w") as out:
        def pip(args: list[str]) -> int:
            cmd = [str(py), "-m", "pip", "install", "--disable-pip-version-check", *args]
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode

        rc = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], stdout=out,
                            stderr=subprocess.STDOUT).returncode
        failed = "venv creation" if rc else None
        for args in ([TORCH], *steps):
            if failed is None and pip(args) != 0:
                failed = "pip install " + " ".join(args)
    if failed:
        tail = logfile.read_text().strip().splitlines()[-3:]
        status = {"ok": False, "reason": f"{failed} failed: {' | '.join(tail)}", "log": str(logfile)}
    else:
        status = _probe(py, module, dist)
        status["python"] = str(py)
    status_file.write_text(json.dumps(status))
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venvs", type=Path, default=DEFAULT_DIR)
    p.add_argument("names", nargs="*", default=list(PEERS))
    args = p.parse_args(argv)
    bad = 0
    for name in args.names:
        if name not in PEERS:
            p.error(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
        s = ensure(name, args.venvs)
        print(f"{name:12s} {'ok ' + s['version'] if s['ok'] else 'FAILED: ' + s['reason']}")
        bad += not s["ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
