"""The user-facing commands run end to end: the demo, inspect, and the documented example."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from olmo_tda.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_quick_end_to_end(tmp_path, capsys):
    assert main(["demo", "--quick", "--no-progress", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("demo: 768 examples captured, self-query top-1 hit rate ")
    hits, total = map(int, last.split("hit rate ")[1].split(",")[0].split("/"))
    assert total == 8 and hits >= 3, last      # a 48-step run already finds most of its own passages
    assert (tmp_path / "demo" / "report.html").read_text().count("<table>") >= 9
    assert (tmp_path / "demo" / "training.png").stat().st_size > 1000

    assert main(["inspect", str(tmp_path / "demo"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_examples"] == 768


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("olmo-tda inspect: error:") and "nothing" in err


def test_docs_example_runs(capsys):
    runpy.run_path(str(ROOT / "docs" / "examples" / "plain_torch.py"), run_name="__main__")
    first = eval(capsys.readouterr().out.strip().splitlines()[-1])[0]   # noqa: S307 (our own print)
    assert first["index"] == 0
