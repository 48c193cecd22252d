"""Benchmarks stay runnable: each runs at toy size and ends with one JSON line of its headline keys.
(The numbers themselves are measured at full size and recorded in docs/BENCHMARKS.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _last_json(script, *args):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_capture_overhead_runs():
    res = _last_json("capture_overhead.py", "--d-model", "64", "--n-layers", "1", "--seq", "16", "--batch", "2",
                     "--vocab", "128", "--rounds", "1", "--block", "1")
    assert res["benchmark"] == "capture_overhead" and res["ratio_k16"] > 0 and res["ratio_k64"] > 0


def test_capture_overhead_breakdown_and_profile():
    """--breakdown adds a capture-only arm per k and each store's drain; --profile prints operator tables."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capture_overhead.py"), "--arch", "linear",
                          "--d-model", "64", "--n-layers", "1", "--seq", "16", "--batch", "2", "--vocab", "128",
                          "--rounds", "1", "--block", "1", "--ks", "8", "--breakdown", "--profile", "plain,k8-cap"],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ratio_k8"] > 0 and res["ratio_k8-cap"] > 0 and res["flush_s_k8"] >= 0
    assert "flush_s_k8-cap" not in res                       # it has no store to drain
    assert "profile of one block of plain" in out and "profile of one block of k8-cap" in out
    # the capture-only arm runs capture's own projections on top of the plain step's matmuls
    plain_table, cap_table = out.split("profile of one block of plain")[1].split("profile of one block of k8-cap")

    def matmul_calls(table):      # whichever of mm/bmm the projections dispatch to
        return sum(int(line.split()[-1]) for line in table.splitlines() if line.split()[:1] in (["aten::mm"],
                                                                                              ["aten::bmm"]))

    assert matmul_calls(cap_table) > matmul_calls(plain_table)
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capture_overhead.py"), "--ks", "8",
                          "--profile", "k8-cap"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "no arm k8-cap" in bad.stderr


def test_projection_fidelity_runs():
    res = _last_json("projection_fidelity.py", "--d-models", "64", "--steps", "5", "--num-train", "16",
                     "--num-queries", "2", "--ks", "64", "--kinds", "orthogonal", "--seeds", "1")
    assert 0.0 < res["spearman_d64_orthogonal_k64"] <= 1.0


def test_tied_head_fidelity_runs():
    """With the tied table captured, exact capture scores are the all-parameter ones (torch.func)."""
    res = _last_json("tied_head_fidelity.py", "--d-models", "64", "--steps", "5", "--num-train", "16",
                     "--num-queries", "2", "--ks", "16", "--seeds", "1")
    assert res["exact_with_table_max_rel_err"] < 1e-4 and res["exact_blocks_only"] < res["exact_with_table"]
    assert len(res["rows"]) == 4


@pytest.mark.slow
def test_full_demo_under_five_minutes(tmp_path, capsys):
    import time

    from olmo_tda.cli import main

    t0 = time.perf_counter()
    assert main(["demo", "--no-progress", "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - t0 < 300
    last = capsys.readouterr().out.strip().splitlines()[-1]
    hits = int(last.split("hit rate ")[1].split("/")[0])
    assert hits >= 7, last


def test_olmo_overhead_runs():
    res = _last_json("olmo_overhead.py", "--d-model", "64", "--n-layers", "1", "--seq", "32", "--rounds", "1",
                     "--block", "1", "--ks", "16,64")
    assert res["benchmark"] == "olmo_overhead"
    assert res["plain_s"] > 0 and res["ratio_k64"] > 0 and res["cpu_ratio_k64"] > 0 and res["ratio_k16"] > 0
    assert (res["d_model"], res["n_layers"], res["seq"], res["batch"], res["microbatch"]) == (64, 1, 32, 8, 8)
    assert res["bytes_per_example_k64"] > res["bytes_per_example_k16"] > 0


def test_deepspeed_overhead_runs():
    res = _last_json("deepspeed_overhead.py", "--d-model", "64", "--n-layers", "1", "--seq", "32", "--vocab", "128",
                     "--rounds", "1", "--block", "1", "--k", "16")
    assert res["benchmark"] == "deepspeed_overhead" and res["zero_stage"] == 2
    assert res["plain_s"] > 0 and res["ratio_k16"] > 0 and res["cpu_ratio_k16"] > 0
    # the 4 Linears of one block + the head at k=16: float32 rows reached the disk
    assert res["bytes_per_example_k16"] > 4 * 16 * 16


def test_lds_runs():
    import math

    res = _last_json("lds.py", "--num-train", "32", "--num-queries", "4", "--retrains", "4", "--epochs", "2",
                     "--checkpoints", "2", "--proj-dim", "8", "--rank", "4", "--d-model", "16", "--n-layers", "1",
                     "--compact-k", "8", "--compact-c", "2", "--budget-k", "4")
    assert res["benchmark"] == "lds" and res["retrains"] == 4
    for key in ("reliability", "lds_graddot", "lds_tracin", "lds_influence_raw", "lds_influence_lorif",
                "lds_influence_ekfac", "lds_graddot_exact", "lds_tracin_exact", "lds_influence_lorif_exact",
                "lds_influence_ekfac_exact", "lds_graddot_compact", "lds_influence_ekfac_compact",
                "lds_graddot_eigen", "lds_influence_raw_eigen", "lds_influence_ekfac_eigen",
                "lds_graddot_budget", "lds_influence_raw_budget", "lds_influence_ekfac_budget",
                "lds_influence_joint", "lds_influence_joint_eigen", "lds_influence_joint_budget"):
        assert math.isfinite(res[key]) and -1.0 <= res[key] <= 1.0, (key, res[key])


def test_lds_adam_arm_runs():
    import math

    res = _last_json("lds.py", "--num-train", "32", "--num-queries", "4", "--retrains", "4", "--epochs", "2",
                     "--checkpoints", "2", "--proj-dim", "8", "--rank", "4", "--d-model", "16", "--n-layers", "1",
                     "--compact-k", "8", "--compact-c", "2", "--budget-k", "0", "--adam")
    adam = {k: v for k, v in res.items() if "adam" in k and isinstance(v, float)}
    assert adam and all(math.isfinite(v) and -1.0 <= v <= 1.0 for v in adam.values()), adam


def test_fidelity_in_run_runs():
    res = _last_json("fidelity_in_run.py", "--steps", "16", "--points", "2", "--window", "2", "--queries", "3",
                     "--train", "128", "--batch", "4", "--every", "8", "--k", "4", "--threads", "1")
    for arm in ("random", "frozen", "following"):
        assert -1.0 <= res[f"{arm}_min"] <= 1.0 and res[f"{arm}_row_error"] < 1e-2, (arm, res)
    assert res["bytes_per_example"] == 2 * 4 * 4 * 9      # bf16 4 x 4 on 2 blocks x 4 Linears + the head
    assert res["basis_versions"] >= 3 and 0 < res["refresh_overhead"] < 1
    assert res["olmo_1b_bytes_per_example"] <= 32768      # the shipped OLMo-1B config's capture


def test_influence_fit_runs():
    res = _last_json("influence_fit.py", "--num-rows", "300", "--k", "8", "--layers", "2", "--rank", "16",
                     "--rounds", "1")
    assert res["benchmark"] == "influence_fit" and res["num_rows"] == 300
    r = res["results"]
    # the fitted state is what each curvature model holds, in float64: D² (raw), D·r + r (lorif),
    # k_out² + k_in² + k_out·k_in (ekfac), per layer
    assert r["raw"]["state_bytes"] == 2 * 64 * 64 * 8 and r["lorif"]["state_bytes"] == 2 * (64 * 16 + 16) * 8
    assert r["ekfac"]["state_bytes"] == 2 * 3 * 64 * 8
    assert r["raw"]["spearman_vs_raw"] == 1.0 and 0 < r["ekfac"]["spearman_vs_raw"] < 1.0


def test_store_query_runs(tmp_path):
    res = _last_json("store_query.py", "--n", "1500", "--batch", "512", "--cs", "1,4", "--rounds", "1",
                     "--block-size", "64", "--query-rank", "8", "--work-dir", str(tmp_path))
    assert res["benchmark"] == "store_query" and res["n"] == 1500 and res["n_small"] == 150
    assert res["recommended_c"] in (1, 4) and res["query_speedup_basis"] in ("cold", "warm")
    assert res["size_ratio"] > 1 and res["query_speedup"] > 0 and 0 < res["spearman"] <= 1
    per = res["per_store"]
    assert per["c1"]["size_ratio"] > per["c4"]["size_ratio"] > 3       # 64x64 floats vs c·(64+64)
    assert per["c4"]["spearman"] > per["c1"]["spearman"] and per["dense"]["spearman"] == 1.0
    assert res["factor_check_max_rel_err"] < 1e-3 and res["peak_mb"] > 0
    # every store again in bf16 (the default compact dtype): half the bytes, the same ranking, and
    # the recommended store is a bf16 one, compared against dense fp32 and against dense bf16
    assert res["recommended_dtype"] == "bfloat16" and res["recommended_store"] == f"c{res['recommended_c']}.bf16"
    for c in ("c1", "c4"):
        assert abs(per[f"{c}.bf16"]["size_ratio"] / per[c]["size_ratio"] - 2) < 0.05
        assert abs(per[f"{c}.bf16"]["spearman"] - per[c]["spearman"]) < 0.01
        assert abs(per[f"{c}.bf16"]["size_ratio_same_dtype"] - per[c]["size_ratio"]) / per[c]["size_ratio"] < 0.05
    assert per["dense.bf16"]["spearman"] > 0.999 and per["dense.bf16"]["dtype"] == "bfloat16"
    assert res["same_dtype"]["size_ratio"] == pytest.approx(per[res["recommended_store"]]["size_ratio_same_dtype"],
                                                            abs=1e-3)
    # the recommended store queried with rank-8 queries is the headline when it keeps Spearman >= 0.9;
    # exact queries on the same store are reported beside it, with the fidelity of each query rank
    rec, arm = res["recommended_store"], f"{res['recommended_store']}+q8"
    fq = res["factored_queries"]
    assert fq["arm"] == arm and set(fq["spearman_by_query_rank"]) == {"0", "1", "2", "4", "8"}
    assert fq["spearman_by_query_rank"]["8"] == fq["spearman"] == per[arm]["spearman"]
    assert fq["spearman_by_query_rank"]["0"] == per[rec]["spearman"]
    assert fq["spearman_by_query_rank"]["1"] < fq["spearman_by_query_rank"]["8"]
    assert res["exact_queries"]["spearman"] == per[rec]["spearman"]
    if per[arm]["spearman"] >= 0.9:
        assert res["recommended_arm"] == arm and res["recommended_query_rank"] == 8
        assert res["spearman"] == per[arm]["spearman"]
        assert res["peak_mb"] == pytest.approx(per[arm]["peak_full_mb"], abs=0.06)
        assert res["peak_mb"] > 0
    else:
        assert res["recommended_arm"] == rec and res["recommended_query_rank"] == 0
    assert not any(tmp_path.iterdir())                                   # stores removed


def test_store_query_subset_of_stores(tmp_path):
    """The 1M mode builds only dense fp32 and the bf16 factor stores (all of them need ~170 GB):
    the recommendation, the memory check and the JSON must work with the rest absent."""
    res = _last_json("store_query.py", "--n", "1200", "--batch", "512", "--cs", "1,4", "--rounds", "1",
                     "--block-size", "64", "--query-rank", "0", "--stores", "dense,c1.bf16,c4.bf16",
                     "--memory-stores", "c4.bf16", "--work-dir", str(tmp_path))
    per = res["per_store"]
    assert set(per) == {"dense", "c1.bf16", "c4.bf16", f"{res['recommended_store']} no-readahead"}
    assert res["recommended_store"] in ("c1.bf16", "c4.bf16") and res["recommended_dtype"] == "bfloat16"
    assert per["c4.bf16"]["peak_full_mb"] > 0 and per["c1.bf16"]["peak_full_mb"] is None
    assert res["recommended_arm"] == res["recommended_store"] and res["factored_queries"] is None
    assert res["query_speedup_cold"] == res["exact_queries"]["query_speedup_cold"]
    assert per["c4.bf16"]["size_ratio_same_dtype"] is None and res["same_dtype"]["size_ratio"] is None
    assert abs(per["c4.bf16"]["size_ratio"] - 64 * 64 * 4 / (4 * 128 * 2)) < 0.5      # fp32 64x64 vs bf16 c·(64+64)
    with pytest.raises(subprocess.CalledProcessError) as err:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_query.py"), "--n", "100", "--stores", "c1.bf16",
                        "--work-dir", str(tmp_path)], check=True, capture_output=True, text=True)
    assert "dense (the reference) is missing" in err.value.stderr
    assert not any(tmp_path.iterdir())


def test_store_read_runs(tmp_path):
    res = _last_json("store_read.py", "--n", "600", "--rounds", "1", "--large", "300x2", "--small", "10x3",
                     "--work-dir", str(tmp_path))
    assert res["benchmark"] == "store_read" and res["shards"] == {"large": 1, "small": 20}
    assert set(res["per_shard_ms"]) == {"reader", "h5py", "query", "checked", "open"}
    assert res["query_small_over_large"] > 0 and set(res["checksum_cost_frac"]) == {"large", "small"}
    assert not any(tmp_path.iterdir())                                   # stores removed
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_read.py"), "--small", "8"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--small must be RxF" in out.stderr


def test_store_open_runs():
    res = _last_json("store_open.py", "--sizes", "4,12", "--rounds", "1")
    assert res["benchmark"] == "store_open" and [r["shards"] for r in res["rows"]] == [5, 13]   # + a round's shard
    assert all(r["open_ms"] > 0 and r["manifest_kb"] > 0 for r in res["rows"])
    assert res["rows"][1]["manifest_kb"] > res["rows"][0]["manifest_kb"]      # one entry per shard
    for sizes, error in (("0", "--sizes must be positive"), ("5", "--sizes needs two counts")):   # one size: no slope
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_open.py"), "--sizes", sizes],
                             capture_output=True, text=True)
        assert out.returncode != 0 and error in out.stderr


def test_store_resume_runs(tmp_path):
    res = _last_json("store_resume.py", "--ranks", "2", "--shards", "6", "--rounds", "1", "--stagger-ms", "5",
                     "--work-dir", str(tmp_path))
    assert res["benchmark"] == "store_resume" and res["failures"] == 0 and res["ranks"] == 2
    assert res["together_ms_median"] > 0 and res["alone_ms"] > 0 and res["replay_ms_per_step"] > 0
    assert not any(tmp_path.iterdir())                                   # store and its copy removed
    kept = tmp_path / "kept"
    _last_json("store_resume.py", "--ranks", "2", "--shards", "3", "--rounds", "1", "--store", str(kept))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_resume.py"), "--ranks", "3",
                          "--shards", "3", "--store", str(kept)], capture_output=True, text=True)
    assert out.returncode != 0 and "holds ranks [0, 1] and 6 shards, not 3 x 3" in out.stderr


def test_store_append_runs(tmp_path):
    res = _last_json("store_append.py", "--n", "320", "--rounds", "1", "--k", "12", "--peak-mb", "8",
                     "--work-dir", str(tmp_path))
    assert res["benchmark"] == "store_append" and res["rows"] == [320, 1280]
    assert res["k"] == 12 and res["row_bytes"] == 9 * 12 * 12 * 4
    # the one-step layout closes windows by flush_mb: as many shards as the per-step one
    assert res["shards"] == {"per_step@320": 1, "one_step@320": 1, "per_step@1280": 3, "one_step@1280": 3}
    assert res["one_step_scaling"] > 0 and res["one_step_over_per_step"] > 0
    assert set(res["cpu_us_per_row"]) == set(res["rows_per_s"]) and min(res["cpu_us_per_row"].values()) > 0
    assert res["peak_mb"] == 8 and res["peak_rss_over_window"] > 0
    assert not any(tmp_path.iterdir())                                   # stores removed
    for bad, message in ((["--n", "10"], "--n must be a positive multiple of 16"), (["--k", "0"], "--k must be >= 1"),
                         (["--peak-mb", "0"], "--peak-mb must be > 0")):
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "store_append.py"), *bad],
                             capture_output=True, text=True)
        assert out.returncode != 0 and message in out.stderr


def test_routing_runs():
    res = _last_json("routing.py", "--tokens", "1,8,64", "--ranks", "1,4", "--query-q", "1,16", "--rounds", "1",
                     "--min-sample-s", "0.001", "--capture-batch", "4", "--ghost-n", "32")
    assert res["benchmark"] == "routing" and set(res["per_op"]) == {"capture", "ghost", "query"}
    assert res["max_auto_over_best"] > 0 and res["worst_case"]["op"] in res["per_op"]
    assert len(res["rows"]) == 3 + 3 + 4
    auto = {(r["op"], r["point"]): r["auto"] for r in res["rows"]}
    assert auto[("capture", "T=1")] == "tokens" and auto[("ghost", "T=64")] == "materialized"


def test_fidelity_bytes_runs():
    res = _last_json("fidelity_bytes.py", "--d-model", "32", "--steps", "3", "--seq", "16", "--num-train", "8",
                     "--num-queries", "2", "--ks", "8", "--ranks", "0,2", "--kinds", "gaussian,eigen@init",
                     "--dtypes", "float32,bfloat16", "--query-ranks", "1,8")
    assert res["benchmark"] == "fidelity_bytes" and res["ref_bytes"] > 0
    best = res["recommended"]
    assert best is not None and best["bytes_ratio"] <= 1 / 32 + 1e-9 and -1 <= best["spearman"] <= 1
    # rank-8 factors of an 8x8 query are no smaller than the query: it stays exact, so the same scores
    assert best["spearman_q8"] == best["spearman"] and -1 <= best["spearman_q1"] <= 1


def test_selection_runs_the_shipped_pool(tmp_path):
    res = _last_json("selection.py", "--pool", "shipped", "--quick", "--arms", "none,random,greats-head,greats-sampled",
                     "--steps", "12", "--batch", "4", "--n-each", "64", "--sample", "6",
                     "--n-val", "16", "--target-examples", "8", "--window", "24", "--every", "4", "--eval-every", "4",
                     "--out", str(tmp_path), "--png", str(tmp_path / "curves.png"))
    assert res["benchmark"] == "selection" and set(res["arms"]) == {
        f"{a}@target" for a in ("none", "random", "greats-head", "greats-sampled")}
    assert res["headline_arm"] == "greats-sampled" and res["config"]["sample"] == 6
    rounds = [json.loads(x) for x in (tmp_path / "greats-sampled-target-s0" / "tda" / "selection" / "rounds.jsonl")
              .read_text().splitlines()]
    assert rounds and all(r["examples_measured"] == 6 and r["examples_rescored"] == 24 for r in rounds)
    assert 0.0 <= res["best_steps_saved_frac"] <= 1.0 and isinstance(res["worst_compute_matched_delta"], float)
    assert res["arms"]["greats-head@target"]["selection_overhead"] > 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_selection_runs_the_natural_pool_with_both_targets(tmp_path):
    res = _last_json("selection.py", "--quick", "--arms", "none,ceiling,sources", "--steps", "12", "--batch", "4",
                     "--n-each", "64", "--n-val", "16", "--target-examples", "4", "--every", "4", "--target-every", "2",
                     "--eval-every", "4", "--out", str(tmp_path))
    assert res["pool"] == "natural" and res["headline_arm"] == "sources" and res["targets"] == ["reference", "code"]
    for key in ("worst_compute_matched_delta", "worst_ci95_high", "best_steps_saved_frac", "selection_overhead"):
        assert isinstance(res[key], float), key
    assert set(res["ceiling_steps_saved"]) == {"reference", "code"}
    assert set(res["arms"]) == {f"{a}@{t}" for a in ("none", "ceiling", "sources") for t in ("reference", "code")}
    rounds = [json.loads(x) for x in (tmp_path / "sources-code-s0" / "tda" / "selection" / "rounds.jsonl")
              .read_text().splitlines()]
    assert [r["step"] for r in rounds] == [4, 8, 12] and [r["target_refreshed"] for r in rounds] == [True, False, True]
    assert set(rounds[0]["source_weight"]) == {"reference", "code", "docstrings", "licenses"}
    # each target's validation and selection target are held out of its training source
    data = tmp_path / "data-s0"
    train = {json.loads(x)["text"] for x in (data / "code" / "passages.jsonl").read_text().splitlines()}
    target = [json.loads(x)["text"] for x in (data / "target-code.jsonl").read_text().splitlines()]
    assert len(train) == 64 and len(target) == 4 and not train & set(target)


def test_selection_refuses_unknown_arms():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "selection.py"), "--quick", "--arms", "none,greats-tail"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "unknown arm 'greats-tail'" in out.stderr


def test_selection_refuses_a_pool_the_filter_arms_would_exhaust():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "selection.py"), "--pool", "shipped", "--quick",
                          "--n-each", "2000"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "would read 8000 candidates but the pool holds 6000" in out.stderr


def test_gpu_overhead_script_dry_run(tmp_path):
    """benchmarks/gpu_overhead.sh (the prepared capture-overhead device check) runs end to end on CPU."""
    env = {**os.environ, "DEVICE": "cpu", "SIZES": "64:1:16:2", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_overhead.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "overhead_d64.txt").read_text()
    assert json.loads(table.strip().splitlines()[-1])["ratio_k16-cap"] > 0
    profile = (tmp_path / "profile.txt").read_text()
    assert "profile of one block of plain" in profile and "profile of one block of k16-cap" in profile


def test_fact_tracing_runs(tmp_path):
    """Toy size: the corpus, prepare, train, knowledge check, BM25, the methods and the variants; the
    last line carries the headline keys --quick prints."""
    res = _last_json("fact_tracing.py", "--people", "3", "--background", "4", "--epochs", "2", "--d-model", "32",
                     "--n-layers", "1", "--seq-len", "64", "--batch", "8", "--proj-dim", "4",
                     "--methods", "influence,gradcos,tracin-inrun", "--out", str(tmp_path / "ft"))
    for key in ("default_method", "mrr", "bm25_mrr", "bm25_recall1", "recall10", "mrr_question", "known",
                "bm25_recall1_all"):
        assert key in res, key
    assert res["default_method"] == "influence joint" and res["queries"] == 9
    assert set(res["methods"]) == {"bm25", "influence joint", "gradcos", "tracin-inrun"}
    assert 0 <= res["methods"]["bm25"]["all"]["recall1"] <= 1 and "adam-cos (÷√v, unit norm)" in res["variants"]
