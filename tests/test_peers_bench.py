"""The peers benchmark's own pieces: its ground truth, our adapter, failure rows, doc regeneration.

The peers themselves live in venvs that CI does not build (they are large and need the network);
`python benchmarks/peers/run.py` creates them. These tests pin down what every peer's number is
measured against: the exact scores, and the Spearman that compares with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import workload as W  # noqa: E402

TINY = W.Workload(d_model=32, n_heads=2, n_layers=1, seq_len=16, n_train=24, n_query=3, batch=8, k=0,
                  warmup_steps=5)


@pytest.fixture(scope="module", params=W.ARCHS)
def workdir(tmp_path_factory, request):
    """The tiny workload on each model: the plain nn.Linear LM, and ai2-olmo's OLMo."""
    d = tmp_path_factory.mktemp(f"peers_work_{request.param}")
    W.prepare(d, replace(TINY, arch=request.param))
    return d


def test_exact_gradients_match_per_example_backward(workdir):
    w, model, train, query = W.load(workdir)
    got = W.exact_gradients(model, train[:5])
    names = W.linear_names(model)
    for i in range(5):
        model.zero_grad(set_to_none=True)
        W.example_losses(model(train[i:i + 1]), train[i:i + 1]).sum().backward()
        want = torch.cat([getattr_path(model, n).weight.grad.reshape(-1) for n in names])
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    exact = np.load(workdir / "exact.npy")
    assert exact.shape == (TINY.n_query, TINY.n_train)
    full = W.exact_gradients(model, query) @ W.exact_gradients(model, train).T
    np.testing.assert_allclose(exact, full.numpy(), rtol=1e-4, atol=1e-3)
    # every Linear is scored, with its shape recorded for the table
    scored = json.loads((workdir / "scored.json").read_text())
    assert list(scored) == names and all(scored[n] == list(getattr_path(model, n).weight.shape) for n in names)
    if w.arch == "olmo":
        from olmo.model import OLMo

        assert isinstance(model.model, OLMo) and names[-1] == "model.transformer.ff_out"
        assert len(names) == 4 * TINY.n_layers + 1          # att_proj, attn_out, ff_proj, ff_out; the head


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="unknown workload arch 'gpt'"):
        W.build_model(replace(TINY, arch="gpt"))


def test_olmo_arch_without_ai2_olmo_names_the_folder_variable(tmp_path):
    """A peer's venv has no ai2-olmo: without OLMO_TDA_PEERS_OLMO_LIB the error says what is missing;
    with it, the folder is appended after the venv's own packages and the model builds."""
    # in the child, 'olmo' is found only inside a folder named olmo_lib that is on sys.path
    block = ("import sys, importlib.abc, importlib.machinery\n"
             "class OnlyFromLib(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name != 'olmo':\n"
             "            return None\n"
             "        libs = [p for p in sys.path if p.endswith('olmo_lib')]\n"
             "        if not libs:\n"
             "            raise ImportError('No module named olmo')\n"
             "        return importlib.machinery.PathFinder.find_spec(name, libs)\n"
             "sys.meta_path.insert(0, OnlyFromLib())\n"
             f"sys.path.insert(0, {str(PEERS)!r})\n"
             "import workload as W\n"
             "m = W.build_model(W.Workload(d_model=16, n_heads=2, n_layers=1, seq_len=8, arch='olmo'))\n"
             "import olmo\n"
             "print(sys.path[-1], olmo.__file__, W.linear_names(m)[-1])\n")
    env = {k: v for k, v in os.environ.items() if k != W.OLMO_LIB_ENV}
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and W.OLMO_LIB_ENV in r.stderr and "needs ai2-olmo" in r.stderr
    # a stand-in folder: the real site-packages, named like venvs.olmo_lib's folder
    import olmo

    lib = tmp_path / "olmo_lib"
    lib.symlink_to(Path(olmo.__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120,
                       env={**env, W.OLMO_LIB_ENV: str(lib)})
    assert r.returncode == 0, r.stderr
    last, olmo_file, head = r.stdout.split()
    assert last == str(lib) and olmo_file.startswith(str(lib)) and head == "model.transformer.ff_out"


def test_olmo_lib_reports_a_missing_pin(monkeypatch, tmp_path):
    import venvs

    monkeypatch.setattr(venvs, "OLMO_IMPORT_DEPS", [*venvs.OLMO_IMPORT_DEPS, "no-such-dist-olmo-tda"])
    res = venvs.olmo_lib(tmp_path, log=lambda m: None)
    assert not res["ok"] and "no-such-dist-olmo-tda" in res["reason"]
    assert not (tmp_path / "_olmo_lib").exists()


def getattr_path(model, name):
    for part in name.split("."):
        model = getattr(model, part)
    return model


def test_spearman_rows_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 50)), rng.normal(size=(4, 50))
    b[1] = a[1] * 3 + 1          # monotone: 1
    b[2] = -a[2]                 # reversed: -1
    want = np.mean([stats.spearmanr(x, y)[0] for x, y in zip(a, b)])
    assert W.spearman_rows(a, b) == pytest.approx(want, abs=1e-12)
    assert W.spearman_rows(a[1:2], b[1:2]) == pytest.approx(1.0)
    assert W.spearman_rows(a[2:3], b[2:3]) == pytest.approx(-1.0)


def test_our_adapter_unprojected_equals_exact(workdir, tmp_path):
    """k=0: the olmo_tda worker's scores (capture → HDF5 store → attribute) are the exact scores."""
    out = tmp_path / "ours.json"
    subprocess.run([sys.executable, str(PEERS / "worker.py"), "olmo_tda", "attr", str(workdir), str(out)],
                   check=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["ok"], res.get("traceback")
    scores, exact = np.load(out.with_suffix(".npy")), np.load(workdir / "exact.npy")
    np.testing.assert_allclose(scores, exact, rtol=1e-3, atol=1e-3 * np.abs(exact).max())
    assert res["examples_per_s"] > 0 and res["bytes_per_example"] > 0 and res["peak_rss_mb"] > 0


def test_unprojected_ekfac_row_equals_ekfac_built_from_the_exact_gradients(workdir, tmp_path):
    """The "olmo_tda unprojected, EK-FAC" row (full gradients stored, hessian=ekfac) against EK-FAC
    assembled here from the torch.func gradients, layer by layer (influence_levers' dense helper)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import influence_levers as IL

    out = tmp_path / "full.json"
    subprocess.run([sys.executable, str(PEERS / "worker.py"), "olmo_tda_full", "infl", str(workdir), str(out)],
                   check=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["ok"], res.get("traceback")
    assert "hessian=ekfac" in res["settings"]
    _, model, train, query = W.load(workdir)
    g, q = W.exact_gradients(model, train).double(), W.exact_gradients(model, query).double()
    want, lo = 0, 0
    for name in W.linear_names(model):
        shape = dict(model.named_modules())[name].weight.shape
        size = shape.numel()
        want = want + IL.projected_ekfac_scores(g[:, lo:lo + size].reshape(-1, *shape),
                                                q[:, lo:lo + size].reshape(-1, *shape))
        lo += size
    got = np.load(out.with_suffix(".npy"))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_worker_reports_a_failure_with_its_reason(workdir, tmp_path):
    out = tmp_path / "tr.json"
    rc = subprocess.run([sys.executable, str(PEERS / "worker.py"), "traker", "overhead", str(workdir), str(out)],
                        timeout=300).returncode
    res = json.loads(out.read_text())
    assert rc == 1 and not res["ok"] and "no in-loop capture" in res["error"]


def test_the_gpu_run_is_refused_without_cuda_and_only_device_aware_adapters_run_off_cpu(tmp_path, monkeypatch):
    """``--device cuda`` (benchmarks/peers/gpu_check.sh on a lent GPU) needs a CUDA torch; off CPU
    every peer and olmo_tda's projected rows run; our unprojected row (tens of GB there) says it runs on
    CPU only; ``--here`` takes a peer from this interpreter (any torch), and a missing one is a failed
    row with the reason."""
    import run as peers
    import venvs

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            peers.main(["--device", "cuda", "--systems", "olmo_tda"])
    with pytest.raises(SystemExit):
        peers.main(["--device", "tpu", "--systems", "olmo_tda"])
    # worker.py silences warnings and logging process-wide: asked in a child of its own
    code = (f"import sys; sys.path.insert(0, {str(PEERS)!r}); import worker, workload\n"
            "gpu, cpu = workload.Workload(device='cuda'), workload.Workload()\n"
            "for s in ('olmo_tda', 'olmo_tda_eigen', 'olmo_tda_head', 'olmo_tda_budget', 'dattri_llm',\n"
            "          'kronfluence', 'dattri', 'traker', 'logix'):\n"
            "    worker._on_device(s, gpu)\n"
            "worker._on_device('olmo_tda_full', cpu)\n"
            "for s in ('olmo_tda_full', 'no_such_system'):\n"
            "    try:\n"
            "        worker._on_device(s, gpu)\n"
            "    except NotImplementedError as e:\n"
            "        print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == ["olmo_tda_full", "no_such_system"], r.stdout
    assert "olmo_tda_full: this benchmark runs it on CPU only (device cuda)" in r.stdout
    monkeypatch.setitem(venvs.PEERS, "fake", ("json", "no-such-dist-for-here", []))
    assert not venvs.here("fake")["ok"] and "no-such-dist-for-here" in venvs.here("fake")["reason"]
    monkeypatch.setitem(venvs.PEERS, "fake", ("pytest", "pytest", []))
    here = venvs.here("fake")                 # this torch need not be the pinned CPU build here
    assert here["ok"] and here["python"] == sys.executable and here["version"] == pytest.__version__
    # the workload on CPU round-trips its device; an older workload.json without it reads as cpu
    TINY.save(tmp_path / "w.json")
    data = json.loads((tmp_path / "w.json").read_text())
    assert data.pop("device") == "cpu"
    (tmp_path / "w.json").write_text(json.dumps(data))
    assert W.Workload.load(tmp_path / "w.json") == TINY


def test_missing_peer_becomes_a_failed_row():
    import run as peers
    import venvs

    probe = venvs._probe(Path(sys.executable), "no_such_peer_module", "no-such-peer")
    assert not probe["ok"] and "no_such_peer_module" in probe["reason"]
    ok = {"ok": True, "examples_per_s": 100.0, "query_s": 0.5, "bytes_per_example": 10.0, "peak_rss_mb": 1.0,
          "settings": "s"}
    status = {"olmo_tda": {"ok": True, "version": "x"}, "traker": {"ok": False, "reason": probe["reason"]},
              "logix": {"ok": True, "version": "0.1.1"}}
    attr = {"olmo_tda": [ok], "traker": [], "logix": [{**ok, "examples_per_s": 50.0, "query_s": 1.0}]}
    loop = {"olmo_tda": [{"ok": True, "overhead": 0.1, "plain_step_s": 1, "capture_step_s": 1.1}],
            "logix": [{"ok": True, "overhead": 0.3, "plain_step_s": 1, "capture_step_s": 1.3}]}
    rows = peers.summarize(["olmo_tda", "traker", "logix"], attr, loop, {"olmo_tda": 0.9, "logix": 0.5}, status)
    assert not rows["traker"]["ok"] and "no_such_peer_module" in rows["traker"]["error"]
    assert rows["logix"]["throughput_ratio"] == pytest.approx(2.0)
    assert rows["logix"]["overhead_ratio"] == pytest.approx(3.0)
    assert rows["logix"]["query_ratio"] == pytest.approx(2.0)
    text = "\n".join(peers.table(rows))
    assert "failed: install: import no_such_peer_module" in text and "| LogIX (logix-ai) | 0.1.1 | 50 | 2.0 |" in text


def test_table_says_what_failed_and_compares_ours_at_the_same_floats():
    """A failed in-loop run is "failed" (not "post hoc only", a claim about the peer); a row whose
    median rests on fewer repeats than asked says so; our best agreement "at the same stored floats"
    leaves out a row of ours that keeps more floats per example than the default."""
    import run as peers

    ok = {"ok": True, "examples_per_s": 100.0, "query_s": 0.5, "bytes_per_example": 10.0, "peak_rss_mb": 1.0,
          "settings": "s", "floats_per_example": 832}
    status = {s: {"ok": True, "version": "1"} for s in ("olmo_tda", "olmo_tda_head", "olmo_tda_budget", "dattri_llm",
                                                         "logix")}
    attr = {"olmo_tda": [ok], "olmo_tda_head": [{**ok, "floats_per_example": 900}],
            "olmo_tda_budget": [{**ok, "floats_per_example": 832}], "dattri_llm": [ok],
            "logix": [ok, {"ok": False, "error": "RuntimeError: boom"}, {**ok, "examples_per_s": 50.0}]}
    loop = {"olmo_tda": [{"ok": True, "overhead": 0.1, "plain_step_s": 1, "capture_step_s": 1.1},
                         {"ok": False, "error": "killed"}],
            "dattri_llm": [{"ok": False, "error": "TypeError: hooks"}]}
    spear = {"olmo_tda": 0.5, "olmo_tda_head": 0.99, "olmo_tda_budget": 0.9, "dattri_llm": 0.4, "logix": 0.45}
    rows = peers.summarize(list(attr), attr, loop, spear, status)
    text = "\n".join(peers.table(rows))
    assert "| dattri-llm | 1 | 100 | 1.0 | failed | — |" in text and "| +10% (1 of 2 repeats ran) |" in text
    assert "| LogIX (logix-ai) (2 of 3 repeats ran) | 1 | 75 |" in text
    assert rows["logix"]["repeat_error"] == "RuntimeError: boom"
    assert peers.headline(rows)["spearman_ours_best"] == 0.9        # not the over-budget row's 0.99


@pytest.mark.parametrize("arch", W.ARCHS)
def test_run_with_ours_only_prints_json(tmp_path, arch):
    out = subprocess.run([sys.executable, str(PEERS / "run.py"), "--systems", "olmo_tda", "--repeats", "1",
                          "--n-train", "32", "--d-model", "32", "--seq-len", "16", "--out", str(tmp_path / "r.json"),
                          "--arch", arch],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert last["systems"]["olmo_tda"]["ok"] and last["throughput_vs_dattri_llm"] is None
    assert 0 < last["spearman_ours"] <= 1
    full = json.loads((tmp_path / "r.json").read_text())
    assert full["rows"]["olmo_tda"]["overhead"] is not None
    assert -1 <= full["rows"]["olmo_tda"]["influence_spearman"] <= 1
    assert full["command"].startswith("python benchmarks/peers/run.py --systems olmo_tda --repeats 1 --n-train 32 "
                                      "--d-model 32 --seq-len 16")       # the flags that made this table
    import run as peers

    text = peers.markdown(full)
    if arch == "olmo":
        assert full["command"].endswith("--arch olmo") and "ai2-olmo's OLMo" in text
        assert "9 bias-free nn.Linear layers scored (attn_out 32×32, ff_out 32×64, att_proj 96×32, ff_proj " \
               "128×32, transformer.ff_out 256×32)" in text
    else:
        assert "13 bias-free nn.Linear layers scored (q 32×32, k 32×32, v 32×32, o 32×32, up 128×32, down " \
               "32×128, head 256×32)" in text


def test_run_all_rewrites_only_its_block():
    sys.path.insert(0, str(ROOT))
    from benchmarks.run_all import replace_block

    doc = "# Benchmarks\n\nhand-written\n"
    once = replace_block(doc, "peers", "table v1", "## Peers")
    assert once.startswith(doc.rstrip()) and "## Peers" in once and "table v1" in once
    twice = replace_block(once + "\nmore hand-written\n", "peers", "table v2", "## Peers")
    assert "table v1" not in twice and "table v2" in twice and twice.count("## Peers") == 1
    assert "more hand-written" in twice and "hand-written" in twice


def test_run_all_headlines_survive_odd_lines(tmp_path, monkeypatch):
    """--all's table: a script whose last line is not JSON is reported as such (the rest still run),
    and a pipe or backtick in a result cannot break its row."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import run_all

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bad.py").write_text("print('{not json')\n")
    (tmp_path / "benchmarks" / "odd.py").write_text("print('{\"note\": \"a|b`c\"}')\n")
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    bad, odd = run_all.run_script("bad", []), run_all.run_script("odd", [])
    assert "json" not in bad and "its last line is not JSON" in bad["error"][0]
    assert odd["json"] == {"note": "a|b`c"}
    row = f"| x | 1 | {run_all._cell(json.dumps(odd['json']))} |"
    assert row.replace("\\|", "").count("|") == 4


def test_exact_influence_equals_the_explicit_damped_inverse():
    """The ground truth of the curvature column: Woodbury on the N×N Gram = the explicit
    per-layer (G_lᵀG_l/N + λ_l I)⁻¹ with λ_l = 0.1·tr(F_l)/D_l."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
    gen = torch.Generator().manual_seed(0)
    g_train, g_query = torch.randn(6, 20, generator=gen), torch.randn(2, 20, generator=gen)
    got = W.exact_influence(model, g_train, g_query)
    want = torch.zeros(2, 6, dtype=torch.float64)
    for lo, size in ((0, 12), (12, 8)):
        g, q = g_train[:, lo:lo + size].double(), g_query[:, lo:lo + size].double()
        fisher = g.T @ g / 6
        lam = W.RELATIVE_DAMPING * torch.trace(fisher) / size
        want += q @ torch.linalg.inv(fisher + lam * torch.eye(size, dtype=torch.float64)) @ g.T
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_influence_levers_rows_and_its_fisher_helper_against_the_exact_influence(tmp_path):
    """``influence_levers``' projected-Fisher helper on unprojected gradients is the exact influence
    (the tested Woodbury ground truth), and every lever row runs on a tiny workload."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import influence_levers as IL

    tiny = W.Workload(d_model=16, n_heads=2, n_layers=1, seq_len=12, n_train=20, n_query=3, batch=4, k=4,
                      warmup_steps=3)
    W.prepare(tmp_path, tiny)
    _, model, train, query = W.load(tmp_path)
    g, q = W.exact_gradients(model, train).double(), W.exact_gradients(model, query).double()
    got, lo = 0, 0
    for name in W.linear_names(model):
        size = dict(model.named_modules())[name].weight.numel()
        got = got + IL.projected_fisher_scores(g[:, lo:lo + size], q[:, lo:lo + size])
        lo += size
    want = torch.from_numpy(np.load(tmp_path / "exact_influence.npy")).double()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3 * want.abs().max().item())
    result = IL.run(tmp_path, seeds=1)
    assert set(result) == {"ekfac_full", "kfac_full", "fisher_kron", "fisher_eigen", "fisher_layer_jl",
                           "fisher_layer_jl2x", "fisher_global_jl", "fisher_global_kron", "precond_then_kron",
                           "exact_precond_then_kron", "precond_then_eigen", "ekfac_kron", "ekfac_eigen",
                           "split_count", "split_deff", "split_size", "split_even", "fisher_eigen_joint",
                           "split_count_joint", "split_count_joint_r32", "split_count_joint_r128",
                           "split_count_joint_r256"}
    assert all(-1 <= r["spearman"] <= 1 for r in result.values())
    # the library's rank-r joint Fisher at r >= D (112 here) is the explicit joint one the script builds
    for rank in (128, 256):
        got = result[f"split_count_joint_r{rank}"]["spearman"]
        assert got == pytest.approx(result["split_count_joint"]["spearman"], abs=1e-3)
    assert result["fisher_kron"]["floats"] == 7 * 16 and result["ekfac_full"]["floats"] == "all"


def test_capture_floor_times_the_four_passes_and_the_projection_gemms(tmp_path):
    """benchmarks/peers/capture_floor.py runs on a tiny workload: every pass is timed, and the GEMM
    table has one row per scored layer with its shape and projected widths."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import capture_floor as CF

    tiny = W.Workload(d_model=16, n_heads=2, n_layers=1, seq_len=12, n_train=16, n_query=2, batch=4, k=4,
                      warmup_steps=2)
    W.prepare(tmp_path, tiny)
    out = CF.run(tmp_path, repeats=1)
    assert set(out["examples_per_s"]) == set(CF.PASSES) and all(v > 0 for v in out["examples_per_s"].values())
    _, model, _, _ = W.load(tmp_path)
    assert [r["layer"] for r in out["gemm_us"]] == W.linear_names(model)
    assert all(r["k"] == [4, 4] and min(r["matmul"], r["proj_in"], r["proj_out_T"]) > 0 for r in out["gemm_us"])
    json.dumps(out)                                      # the script's last line


@pytest.mark.parametrize("arch", W.ARCHS)
def test_capture_floor_minimal_and_fused_passes_compute_projected_exact_gradients(tmp_path, arch):
    """The floor passes are timed only if they do the work: each layer's [B, k, k] equals
    P_out G_i P_inᵀ of the exact per-example gradient from torch.func."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import capture_floor as CF
    from olmo_tda import CaptureConfig

    tiny = W.Workload(arch=arch, d_model=16, n_heads=2, n_layers=1, seq_len=12, n_train=8, n_query=2, batch=4,
                      k=4, warmup_steps=2)
    W.prepare(tmp_path, tiny)
    _, model, train, _ = W.load(tmp_path)
    batch = train[:4]
    cfg = CaptureConfig(proj_dim=4, seed=3)
    exact = W.exact_gradients(model, batch)
    cap = CF.GradientCapture(model, cfg)
    expected, col = {}, 0
    for name in W.linear_names(model):                   # exact_gradients' column order
        module = cap.modules[name]
        size = module.weight.numel()
        g = exact[:, col:col + size].reshape(len(batch), *module.weight.shape)
        col += size
        p_out, p_in = cap.projectors[name].matrices()
        expected[name] = p_out @ g @ p_in.T
    cap.remove()
    assert col == exact.shape[1]
    for kind in ("minimal", "fused"):
        got = CF.products(kind, model, cfg, batch)
        assert set(got) == set(expected), kind
        for name, want in expected.items():
            torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=f"{kind} {name}")
    assert all(type(m).forward is m.forward.__func__ for m in cap.modules.values())   # forwards restored


def test_sweep_parses_points_and_tabulates_its_pairs(tmp_path):
    """sweep.py: bad points are refused by name; a point that times out is a failed row with its
    reason; the summary's min/median/target count come from the measured points only."""
    import sweep

    assert sweep.parse_points("linear:64:16, olmo:128:8") == [("linear", 64, 16), ("olmo", 128, 8)]
    for bad in ("linear:64", "gpt:64:8", "linear:64:0", "linear:66:8", "linear:x:8", " , "):
        with pytest.raises(ValueError, match="bad point|no points"):
            sweep.parse_points(bad)

    def measured(ours, theirs, bare=1000.0):
        return {"point": ("linear", 64, 8), "ok": True, "rows": {
            "olmo_tda": {"ok": True, "examples_per_s": ours, "bare_pass_examples_per_s": bare,
                         "bytes_per_example": 3376.0, "spearman": 0.5, "influence_spearman": 0.4},
            "dattri_llm": {"ok": True, "examples_per_s": theirs, "throughput_ratio": ours / theirs,
                           "overhead_ratio": 3.0, "bytes_per_example": 55509.0, "spearman": 0.45}}}
    timed_out = sweep.run_point(("linear", 32, 4), ["dattri_llm"], 1, 0.01, tmp_path / "p.json", [])
    assert not timed_out["ok"] and "timed out" in timed_out["error"]
    refused = sweep.run_point(("linear", 32, 4), ["no_such_peer"], 1, 120, tmp_path / "q.json", [])
    assert not refused["ok"] and "run.py exited 2" in refused["error"] and "no_such_peer" in refused["error"]
    missing_peer = {**measured(600, 300), "rows": {**measured(600, 300)["rows"], "dattri_llm": {
        "ok": False, "error": "install: pip failed | attr: crashed"}}}
    pairs = [sweep.pair(r, "dattri_llm")
             for r in (measured(600, 250), measured(540, 300, bare=570), timed_out, missing_peer)]
    assert pairs[0]["ratio"] == pytest.approx(2.4) and pairs[0]["ours_of_bare"] == pytest.approx(0.6)
    assert pairs[0]["peer_of_bare"] == pytest.approx(0.25) and pairs[0]["peer_influence"] is None
    assert not pairs[2]["ok"] and not pairs[3]["ok"] and "dattri_llm: install: pip failed" in pairs[3]["error"]
    text = "\n".join(sweep.table(pairs))
    cells = {line.replace("\\|", "").count("|") for line in text.splitlines()}
    assert cells == {15}, text                            # every row, failed or not, has the header's 14 columns
    assert "| linear | 64 | 8 | dattri_llm | 600 | 250 | 2.400 | 4.00 | 0.60 | 0.25 | 3.0 | 3376 / 55509 " \
           "| 0.500 / 0.450 | 0.400 / — |" in text
    assert "failed: timed out after 0.01 s" in text and text.count("| failed:") == 2
    s = sweep.summary(pairs)["dattri_llm"]
    assert s == {"points": 2, "failed": 2, "min_ratio": pytest.approx(1.8), "median_ratio": pytest.approx(2.1),
                 "at_least_2x": 1, "ceiling_below_2x": 1}
    bad = subprocess.run([sys.executable, str(PEERS / "sweep.py"), "--points", "linear:64"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "bad point 'linear:64'" in bad.stderr


def test_seed_spread_is_exact_when_nothing_is_projected_and_spreads_when_it_is(tmp_path):
    """benchmarks/peers/seed_spread.py: at k no smaller than any layer side the library's projector is
    the identity, so every seed's scores are the exact ones (Spearman 1); at k = 2 they are not, and the
    layers' shares of the exact score mass sum to 1."""
    def spread(k):
        out = subprocess.run([sys.executable, str(PEERS / "seed_spread.py"), "--d-model", "16", "--n-layers", "1",
                              "--seq-len", "8", "--n-train", "24", "--batch", "4", "--k", str(k), "--seeds", "2",
                              "--workdir", str(tmp_path / "w")], check=True, capture_output=True, text=True,
                             timeout=300).stdout
        return json.loads(out.strip().splitlines()[-1])

    exact = spread(256)                          # vocab 256 is the widest side
    assert all(v == pytest.approx(1.0) for vals in exact["spearman"].values() for v in vals), exact["spearman"]
    assert sum(exact["score_mass_share"].values()) == pytest.approx(1.0) and "head" in exact["score_mass_share"]
    projected = spread(2)
    for kind, vals in projected["spearman"].items():
        assert len(vals) == 2 and all(-1 <= v < 0.999 for v in vals), (kind, vals)
