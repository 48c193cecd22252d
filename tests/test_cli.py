"""The user-facing commands run end to end: the demo, inspect, and the documented example."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from olmo_tda.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_quick_then_attribute_and_inspect(tmp_path, capsys):
    """The demo runs OLMo pretraining with capture, answers its queries, and leaves a run that
    `olmo-tda attribute` and `inspect` can open."""
    out = tmp_path / "demo"
    env_before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 0
    # the one-process group is gone and so are its variables (a later subprocess picks its own port)
    assert {k: os.environ.get(k) for k in env_before} == env_before
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: 512 examples captured, self-query top-1 hit rate ")
    hits, total = map(int, last.split("hit rate ")[1].split(",")[0].split("/"))
    assert total == 8 and hits >= 7, last
    assert (out / "report.html").read_text().count("<table>") >= 9
    assert (out / "training.png").stat().st_size > 1000
    assert (out / "run" / "config.yaml").exists() and (out / "run" / "tda.yaml").exists()

    # a training passage, asked through the CLI, finds itself first; JSON has the documented shape
    passage = json.loads((out / "data" / "passages.jsonl").read_text().splitlines()[5])
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"text": passage["text"]}) + "\n")
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "gradcos", "--top-k", "3",
                 "--json", str(tmp_path / "a.json")]) == 0
    answers = json.loads((tmp_path / "a.json").read_text())
    assert answers[0]["query"] == passage["text"]
    top = answers[0]["results"][0]
    assert set(top) == {"index", "source", "score", "text"} and top["index"] == passage["index"]
    assert top["text"] == passage["text"] and top["source"] == "train"
    # by row: (example, step) rows as stored; the CLI's stdout holds the summary only when --json is given
    capsys.readouterr()
    assert main(["attribute", str(out), "--query-file", str(qfile), "--group-by", "row", "--top-k", "3",
                 "--json", str(tmp_path / "rows.json")]) == 0
    out_lines = capsys.readouterr().out.splitlines()      # the method's settings line and the summary
    assert len(out_lines) == 2 and out_lines[0].startswith("influence: hessian joint") and out_lines[1].startswith("wrote")
    rows = json.loads((tmp_path / "rows.json").read_text())[0]["results"]
    assert set(rows[0]) == {"index", "step", "source", "score", "text"} and rows[0]["index"] == passage["index"]

    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_examples"] == 512 and summary["num_rows"] == 1024
    traj = summary["trajectory"]
    assert traj["steps"] == [0, 16, 32, 48, 64] and traj["bytes"] == sum(traj["bytes_each"]) > 0

    # TracIn-CP over those checkpoints, and in-run TracIn, from the CLI: the passage still comes first
    for method in ("tracin", "tracin-inrun"):
        assert main(["attribute", str(out), "--query-file", str(qfile), "--method", method, "--top-k", "3",
                     "--json", str(tmp_path / f"{method}.json"), "--html", str(tmp_path / f"{method}.html")]) == 0
        page = (tmp_path / f"{method}.html").read_text()
        assert page.count("<tr><td>") == 3 and "<td>train</td>" in page and method in page
        results = json.loads((tmp_path / f"{method}.json").read_text())[0]["results"]
        assert len(results) == 3 and all("step" not in r and np.isfinite(r["score"]) for r in results)
        if method == "tracin":   # in-run TracIn pairs each step with a checkpoint up to 8 steps away here
            assert results[0]["index"] == passage["index"], results[0]
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "tracin", "--group-by", "row"]) == 2
    assert "scores examples (summed over checkpoints or steps), not rows" in capsys.readouterr().err
    # from Python, as the README shows: the package's OLMoRun opens the demo's folder as the CLI does
    import olmo_tda

    scores, ids = olmo_tda.OLMoRun(out).tracin([passage["text"]])
    assert olmo_tda.OLMoRun(out).dir == olmo_tda.open_run(out).dir == out / "run"
    assert int(ids[int(scores[0].argmax())]) == passage["index"]
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "influence", "--hessian", "lorif",
                 "--rank", "16", "--json", str(tmp_path / "influence.json"),
                 "--html", str(tmp_path / "infl.html")]) == 0
    assert capsys.readouterr().out.startswith("influence: hessian lorif, rank 16, damping λ per layer")
    answer = json.loads((tmp_path / "influence.json").read_text())[0]
    assert answer["results"][0]["index"] == passage["index"] and len(answer["damping"]) == 9
    # what decided the scores is saved with them, λ above all (its range over the layers)
    settings, damping = answer["settings"], answer["damping"]
    assert settings["method"] == "influence" and settings["hessian"] == "lorif" and settings["rank"] == 16
    assert settings["damping"] == f"{min(damping.values()):.3g}..{max(damping.values()):.3g}"
    page = (tmp_path / "infl.html").read_text(encoding="utf-8")
    assert f"<tr><th>damping</th><td>{settings['damping']}</td></tr>" in page and "<td>lorif</td>" in page
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "influence", "--hessian", "ekfac",
                 "--json", str(tmp_path / "ekfac.json")]) == 0
    assert capsys.readouterr().out.startswith("influence: hessian ekfac, damping λ per layer")
    assert json.loads((tmp_path / "ekfac.json").read_text())[0]["results"][0]["index"] == passage["index"]
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "influence", "--hessian", "joint",
                 "--json", str(tmp_path / "joint.json")]) == 0
    text = capsys.readouterr().out
    assert text.startswith("influence: hessian joint, damping λ (one, all layers) ")
    lam = text.split("all layers) ")[1].split(" over")[0]
    assert ".." not in lam and float(lam) > 0                           # one λ for the whole model
    assert json.loads((tmp_path / "joint.json").read_text())[0]["results"][0]["index"] == passage["index"]
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "influence", "--hessian", "joint",
                 "--rank", "32", "--json", str(tmp_path / "joint32.json")]) == 0
    assert capsys.readouterr().out.startswith("influence: hessian joint, rank 32, damping λ (one, all layers) ")
    assert json.loads((tmp_path / "joint32.json").read_text())[0]["results"][0]["index"] == passage["index"]
    # rank-2 queries (the CLI's --query-rank): the API's scores with query_rank=2, not the exact ones
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "graddot", "--top-k", "5",
                 "--query-rank", "2", "--json", str(tmp_path / "q2.json")]) == 0
    from olmo_tda.integrations.olmo_query import open_run
    run = open_run(out / "run")
    assert json.loads((tmp_path / "q2.json").read_text())[0]["settings"] == {"method": "graddot", "query_rank": 2, "group_by": "example",
                                                                            "route": "auto"}
    got = json.loads((tmp_path / "q2.json").read_text())[0]["results"]
    want = run.attribute([passage["text"]], method="graddot", top_k=5, query_rank=2)[0]["results"]
    exact = run.attribute([passage["text"]], method="graddot", top_k=5)[0]["results"]
    assert [r["index"] for r in got] == [r["index"] for r in want]
    np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], rtol=1e-5)
    assert not np.allclose([r["score"] for r in got], [r["score"] for r in exact], rtol=1e-3)
    assert main(["attribute", str(out), "--query", "x y", "--method", "tracin", "--query-rank", "2"]) == 2
    assert "--query-rank applies to graddot, gradcos and influence" in capsys.readouterr().err
    assert main(["attribute", str(out), "--query", "x y", "--method", "influence", "--hessian", "ekfac",
                 "--rank", "16"]) == 2
    assert "--rank is the rank of --hessian lorif or joint (the default), not of ekfac" in capsys.readouterr().err
    assert main(["attribute", str(out), "--query", "x y", "--method", "gradcos", "--damping", "1"]) == 2
    assert "apply to --method influence" in capsys.readouterr().err
    assert main(["attribute", str(out), "--query", "x y", "--method", "influence", "--damping", "1",
                 "--damping-ratio", "1"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    # --damping-ratio 1.0: each layer's λ is 10x the default ratio 0.1's (the lines above printed those)
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "influence", "--hessian", "ekfac",
                 "--damping-ratio", "1.0", "--json", str(tmp_path / "ratio1.json")]) == 0
    capsys.readouterr()
    ratio1 = json.loads((tmp_path / "ratio1.json").read_text())[0]["damping"]
    default = json.loads((tmp_path / "ekfac.json").read_text())[0]["damping"]
    assert ratio1.keys() == default.keys()
    assert all(abs(ratio1[n] / default[n] - 10) < 1e-9 for n in default)
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text(f"{passage['index']}\n7, 9\n")
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "tracin", "--ids", f"@{ids_file}",
                 "--json", str(tmp_path / "subset.json")]) == 0
    results = json.loads((tmp_path / "subset.json").read_text())[0]["results"]
    assert sorted(r["index"] for r in results) == sorted([passage["index"], 7, 9])
    assert results[0]["index"] == passage["index"]
    assert main(["attribute", str(out), "--query", "x y", "--method", "tracin", "--ids", "7,x"]) == 2
    assert "--ids: expected integers" in capsys.readouterr().err
    assert main(["attribute", str(out), "--query", "x y", "--method", "tracin", "--ids", "100000"]) == 2
    assert "instance indices in [0, 512)" in capsys.readouterr().err

    # a query longer than the model's 64 tokens is scored on its first 64, and the answer says so
    longer = passage["text"] + " and then some words past the model's max_sequence_length"
    assert main(["attribute", str(out), "--query", longer, "--top-k", "1", "--json", str(tmp_path / "long.json")]) == 0
    answer = json.loads((tmp_path / "long.json").read_text())[0]
    assert answer["query"] == longer and answer["scored_tokens"] == 64 and answer["tokens"] == len(longer.encode())
    assert answer["results"][0]["index"] == passage["index"]
    capsys.readouterr()
    assert main(["attribute", str(out), "--query", longer, "--top-k", "1"]) == 0
    assert "(scored on its first 64 of" in capsys.readouterr().out
    # refused before any work: an output file in a folder that does not exist, a query file not UTF-8
    assert main(["attribute", str(out), "--query", "x y", "--json", str(tmp_path / "no" / "a.json")]) == 2
    assert f"--json {tmp_path / 'no' / 'a.json'}: no such folder" in capsys.readouterr().err
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe{}\n")
    assert main(["attribute", str(out), "--query-file", str(tmp_path / "bin.jsonl")]) == 2
    assert f"--query-file {tmp_path / 'bin.jsonl'}: not UTF-8 text" in capsys.readouterr().err

    # the report takes the demo's folder (its run is in run/)
    assert main(["report", str(out)]) == 0
    assert (out / "run" / "tda" / "report.html").is_file()

    # 64 flipped bytes inside one shard's gradients: attribute refuses, naming the shard and the layer;
    # --skip-damaged answers without that shard and says how many rows it left out
    import h5py

    shard = sorted((out / "run" / "tda" / "store" / "shards").glob("*.h5"))[0]
    with h5py.File(shard, "r") as f:
        at, rows = f["grads/L0002"].id.get_offset() + 256, len(f["ids"])
    data = bytearray(shard.read_bytes())
    data[at:at + 64] = bytes(b ^ 0x5A for b in data[at:at + 64])
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "gradcos"]) == 2
    err = capsys.readouterr().err
    assert f"{shard.name}: layer " in err and "(grads/L0002) is damaged" in err and "--skip-damaged" in err
    assert main(["attribute", str(out), "--query-file", str(qfile), "--method", "gradcos", "--skip-damaged",
                 "--json", str(tmp_path / "skip.json")]) == 0
    assert capsys.readouterr().out.startswith(f"skipped {rows} rows of 1 damaged shards (shards/{shard.name})")
    assert json.loads((tmp_path / "skip.json").read_text())[0]["settings"]["skipped_rows"] == rows


def test_damaged_or_moved_run_files(tmp_path, capsys):
    """A run whose saved files were damaged is refused in one line naming the file; one whose store
    and trajectory were moved (its tda.yaml says where), whose selection target is gone, or which has
    a stray folder named like a checkpoint, is still queried and inspected."""
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 0
    run = out / "run"
    passage = json.loads((out / "data" / "passages.jsonl").read_text().splitlines()[5])
    capsys.readouterr()

    def attribute(folder) -> int:
        return main(["attribute", str(folder), "--query", passage["text"], "--top-k", "1",
                     "--json", str(tmp_path / "a.json")])

    saved = {name: (run / name).read_text() for name in ("tda.yaml", "config.yaml")}
    for name, text, message in (("tda.yaml", "tda:\n  capture: [\n", "tda.yaml: not valid YAML"),
                                ("tda.yaml", "- 1\n", "tda.yaml: expected a mapping with a tda: section, got list"),
                                ("tda.yaml", "tda:\n  capture:\n    proj_dimm: 8\n",
                                 "tda.yaml: tda.capture.proj_dimm: unknown key"),
                                ("config.yaml", "model: [\n", "config.yaml: not a readable OLMo config")):
        (run / name).write_text(text)
        assert attribute(run) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run / name}" in err and message in err, err
        (run / name).write_text(saved[name])

    # moved store and trajectory, a selection target that is gone, a stray stepX-unsharded folder
    shutil.move(str(run / "tda" / "store"), str(tmp_path / "store"))
    shutil.move(str(run / "tda" / "trajectory"), str(tmp_path / "trajectory"))
    tda = yaml.safe_load(saved["tda.yaml"])
    tda["tda"]["store"]["path"], tda["tda"]["trajectory"]["path"] = str(tmp_path / "store"), str(tmp_path / "trajectory")
    tda["tda"]["selection"].update(enabled=True, target=str(tmp_path / "gone.txt"))
    (run / "tda.yaml").write_text(yaml.safe_dump(tda))
    (run / "stepfoo-unsharded").mkdir()
    assert attribute(out) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "a.json").read_text())[0]["results"][0]["index"] == passage["index"]
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(tmp_path / "store") and summary["num_rows"] == 1024
    assert summary["trajectory"]["path"] == str(tmp_path / "trajectory")

    # the report reads past a torn last line of the metrics; a folder with nothing to report on is
    # refused without a tda/ folder made in it
    metrics = run / "tda" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 99, "train/Cross')
    assert main(["report", str(run)]) == 0
    assert main(["report", str(tmp_path / "typo")]) == 2
    assert "no tda/metrics.jsonl" in capsys.readouterr().err and not (tmp_path / "typo").exists()
    metrics.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert main(["report", str(run)]) == 2
    assert f"{metrics}:2: corrupt line (not JSON)" in capsys.readouterr().err


def test_attribute_needs_a_query(tmp_path, capsys):
    assert main(["attribute", str(tmp_path), "--query", "x"]) == 2
    assert "not an olmo-tda run directory" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("olmo-tda inspect: error:") and "nothing" in err


def test_a_failed_train_rank_of_several_ends_its_process_and_nothing_else_does(tmp_path, capsys, monkeypatch):
    """A failed ``train`` still in a process group of several ranks reports its error and ends the
    process through integrations.end_failed_rank (the 2-rank refusal test runs that for real); other
    commands, and a train without such a group (WORLD_SIZE set or not), return their status as always."""
    import olmo_tda.integrations as integrations

    real = integrations.one_of_several_ranks
    ended = []
    monkeypatch.setattr(integrations, "end_failed_rank", ended.append)
    for several, command, expect in ((True, "inspect", []), (True, "train", [2]), (False, "train", [])):
        monkeypatch.setattr(integrations, "one_of_several_ranks", lambda several=several: several)
        ended.clear()
        args = [command, str(tmp_path / ("missing.yaml" if command == "train" else "nothing"))]
        assert main(args) == 2 and ended == expect, (several, command)
        assert "error:" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not real()                   # the launcher's variable alone is no group: nothing waits on a peer
    code = ("import atexit; from olmo_tda.integrations import end_failed_rank; atexit.register(print, 'teardown'); "
            "print('reported'); end_failed_rank(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}     # stdout to a pipe: buffered
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 3 and done.stdout == "reported\n", done    # flushed, no atexit teardown


def test_docs_example_runs(capsys):
    runpy.run_path(str(ROOT / "docs" / "examples" / "plain_torch.py"), run_name="__main__")
    first = eval(capsys.readouterr().out.strip().splitlines()[-1])[0]   # noqa: S307 (our own print)
    assert first["index"] == 0


def test_html_report_is_utf8_whatever_the_locale(tmp_path):
    """The page says it is UTF-8: under an ASCII locale (C, no UTF-8 mode) passages in any script are
    still written, as UTF-8, escaped."""
    script = ("import sys; from pathlib import Path; from olmo_tda.report.html import write_attribution_report as w; "
              "w(Path(sys.argv[1]), title='t', summary={'λ': '1e-3'}, queries=[{'query': 'café <b>', "
              "'results': [{'index': 1, 'step': 2, 'score': 0.5, 'text': 'naïve 数据 \\U0001F600 </code>'}]}])")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "PYTHONIOENCODING": ""}
    (tmp_path / "w.py").write_text(script, encoding="utf-8")     # source files are read as UTF-8 anyway
    done = subprocess.run([sys.executable, str(tmp_path / "w.py"), str(tmp_path / "r.html")], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0, done.stderr
    page = (tmp_path / "r.html").read_bytes().decode("utf-8")
    assert "café &lt;b&gt;" in page and "naïve 数据 \U0001F600 &lt;/code&gt;" in page and "<th>λ</th>" in page


def test_demo_into_a_folder_named_with_yaml_syntax_and_its_queries_uncut(tmp_path, caplog):
    """A folder whose name has `,` and `]` (which OLMo's dotted overrides read as YAML) holds the whole
    demo, and the demo's free-text queries fit the model's context, so none is cut (or warned about).
    The API with a tiny config: the same path as `olmo-tda demo`, in seconds instead of a minute."""
    import logging

    from olmo_tda.demo.run import FREE_QUERIES, DemoConfig, run_demo
    from olmo_tda.integrations.olmo_query import open_run

    out = tmp_path / "out,1]x"
    with caplog.at_level(logging.WARNING, logger="olmo_tda"):
        summary = run_demo(out, DemoConfig(num_passages=64, epochs=1, num_self_queries=2), progress=False)
    assert summary.examples_captured == 64
    assert all((out / name).is_file() for name in ("report.html", "results.json", "training.png"))
    saved = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert saved["data"]["paths"] == [str(out / "data" / "train.npy")] and Path(saved["save_folder"]) == out / "run"
    run = open_run(out / "run")
    limit = run.cfg.model.max_sequence_length
    assert all(len(run.tokenizer.encode(q)) <= limit for q in FREE_QUERIES), [len(q.encode()) for q in FREE_QUERIES]
    free = [a for a in summary.results if a["kind"] == "free-text query"]
    assert [a["query"] for a in free] == FREE_QUERIES and not any("scored_tokens" in a for a in free)
    assert "max_sequence_length) are scored" not in caplog.text


def test_the_run_readers_come_from_the_package_without_importing_olmo_before_use():
    """``from olmo_tda import OLMoRun`` (the README's spelling) works, and ``import olmo_tda`` alone
    does not import OLMo (capture in a plain torch loop never needs it)."""
    code = ("import sys, olmo_tda; assert 'olmo' not in sys.modules, 'olmo imported'; "
            "from olmo_tda import OLMoRun, DeepSpeedRun, open_run; assert 'olmo' in sys.modules; "
            "assert issubclass(DeepSpeedRun, OLMoRun) and callable(open_run)\n"
            "try:\n    olmo_tda.NoSuchThing\nexcept AttributeError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "module 'olmo_tda' has no attribute 'NoSuchThing'"
