"""Answers that name the training data: grouping rows into examples, documents and sources (oracle:
brute force over the rows and the tokens of a memmap with known document boundaries), prompt → answer
query gradients (oracle: torch.func's gradient of the completion loss), and ``prepare`` → ``train`` →
``attribute --group-by source`` on three files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_tda import CaptureConfig, GradientCapture, GradientRecord, GradientStore, StoreConfig, attribute
from olmo_tda.data import Corpus, prepare, read_documents
from olmo_tda.demo.corpus import ByteTokenizer
from olmo_tda.methods.grouping import ByDocument, BySource
from olmo_tda.methods.queries import Query, query_gradients, read_queries
from conftest import exact_per_example_grads, rel_err, tiny_olmo

ROOT = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()
SEQ = 8


def _docs(rng, n, prefix):
    return [{"id": f"{prefix}{j}", "text": "".join(rng.choice(list("abcdefg "), size=rng.integers(1, 20)))}
            for j in range(n)]


@pytest.fixture
def corpus_and_store(tmp_path):
    """Two prepared files of short documents (many per instance, some across instances), and a store
    of random rows, examples drawn at several steps."""
    rng = np.random.default_rng(0)
    files = []
    for name, n in (("alpha", 30), ("beta", 17)):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps(d) + "\n" for d in _docs(rng, n, name)))
        files.append(f)
    paths = prepare(files, tmp_path / "data", encode=TOK.encode, eos_token_id=TOK.eos_token_id)
    corpus = Corpus(paths, seq_len=SEQ, eos_token_id=TOK.eos_token_id, decode=TOK.decode)
    meta = {"capture": {}, "projector_hash": "h", "layers": [{"name": "fc", "shape": [2, 3], "projector": {}}]}
    rows = []
    with GradientStore.create(tmp_path / "store", meta, StoreConfig(flush_every=2)) as w:
        for step in range(5):
            ids = rng.choice(corpus.num_instances, size=6, replace=False)
            grads = torch.randn(len(ids), 2, 3, generator=torch.Generator().manual_seed(step))
            w.append(GradientRecord(ids=ids, step=step, lr=0.1, loss_scale=1.0, grads={"fc": grads}))
            rows += [(int(i), step, grads[k]) for k, i in enumerate(ids)]
    return corpus, paths, GradientStore.open(tmp_path / "store"), rows


def test_documents_and_sources_come_from_the_tokens(corpus_and_store):
    corpus, paths, _, _ = corpus_and_store
    assert corpus.sources == ["alpha", "beta"] and corpus.num_documents == 47
    tokens = np.fromfile(paths[1], dtype=np.uint16)
    assert corpus.files[1].num_instances == len(tokens) // SEQ
    first_beta = corpus.files[1].first_doc
    assert corpus.document_name(first_beta + 2) == "beta2"
    beta2 = next(d for _, d in [(0, t) for t in read_documents(paths[1].parent.parent / "beta.jsonl")]
                 if d[0] == "beta2")[1]
    assert corpus.document_text(first_beta + 2) == beta2 and corpus.document_source(first_beta + 2) == "beta"
    # without the prepare index, documents are split at the end-of-text tokens: the same documents
    index = Path(str(paths[0]) + ".docs.npz")
    index.unlink()
    plain = Corpus(paths, seq_len=SEQ, eos_token_id=TOK.eos_token_id, decode=TOK.decode)
    assert plain.num_documents == 47 and plain.document_name(3) == "alpha:3"
    assert plain.document_text(3) == corpus.document_text(3)


def _token_docs(paths):
    """Per global instance: the global document of each of its tokens (counting end-of-text ids)."""
    out, doc0 = [], 0
    for path in paths:
        tokens = np.fromfile(path, dtype=np.uint16)
        doc = doc0 + np.concatenate([[0], np.cumsum(tokens == TOK.eos_token_id)[:-1]])
        n = len(tokens) // SEQ
        out += [doc[i * SEQ:(i + 1) * SEQ] for i in range(n)]
        doc0 = int(doc[-1]) + 1
    return out


def test_grouped_scores_equal_brute_force_over_rows(corpus_and_store):
    corpus, paths, store, rows = corpus_and_store
    query = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(7))
    row_score = {k: (query.flatten(1) @ g.flatten()).double() for k, (_, _, g) in enumerate(rows)}
    token_docs = _token_docs(paths)
    sources = corpus.source_of(np.arange(corpus.num_instances))
    want = {"example": {}, "document": {}, "source": {}}
    for k, (i, _, _) in enumerate(rows):
        s = row_score[k]
        want["example"][i] = want["example"].get(i, 0) + s
        for d in token_docs[i]:
            want["document"][int(d)] = want["document"].get(int(d), 0) + s / SEQ
        src = int(sources[i])
        want["source"][src] = want["source"].get(src, 0) + s
    for name, group_by in (("example", "example"), ("document", ByDocument(corpus)), ("source", BySource(corpus))):
        got = attribute(store, {"fc": query}, method="graddot", top_k=1000, group_by=group_by)
        assert got.group_by == name and (got.steps == -1).all()
        for q in range(2):
            expect = sorted(want[name].items(), key=lambda kv: (-float(kv[1][q]), kv[0]))
            assert [int(g) for g in got.ids[q]] == [g for g, _ in expect], name
            np.testing.assert_allclose(got.scores[q].numpy(), [float(v[q]) for _, v in expect], rtol=1e-5, atol=1e-6)
    # a document's shares add up: the sum over documents equals the sum over examples
    docs = attribute(store, {"fc": query}, method="graddot", top_k=1000, group_by=ByDocument(corpus))
    examples = attribute(store, {"fc": query}, method="graddot", top_k=1000, group_by="example")
    np.testing.assert_allclose(docs.scores.sum(1).numpy(), examples.scores.sum(1).numpy(), rtol=1e-9)
    with pytest.raises(ValueError, match="needs the training data: pass ByDocument"):
        attribute(store, {"fc": query}, group_by="document")
    with pytest.raises(ValueError, match="group_by must be one of"):
        attribute(store, {"fc": query}, group_by="page")


def test_completion_query_gradient_equals_torch_func():
    """The query gradient of a prompt → answer query is the gradient of the answer tokens' summed loss
    only; the prompt's tokens contribute no loss."""
    model = tiny_olmo()
    prompt, answer = [5, 17, 3, 40, 41], [7, 9, 11]
    tokens, first = Query("p", "a").tokens(lambda s: prompt if s == "p" else answer, eos_token_id=0, max_len=32)
    assert tokens == [0, *prompt, *answer] and first == 1 + len(prompt)
    capture = GradientCapture(model, CaptureConfig(proj_dim=0, include_bias=False))
    got = query_gradients(model, capture, [(tokens, first), (tokens, 1)])
    capture.remove()
    ids = torch.tensor([tokens])
    mask = (torch.arange(len(tokens)) >= first).long()[None]
    completion = exact_per_example_grads(model, ids, mask)
    whole = exact_per_example_grads(model, ids)
    for name in ("transformer.blocks.0.att_proj", "transformer.blocks.1.ff_out", "transformer.ff_out"):
        assert rel_err(got[name][0], completion[f"{name}.weight"][0]) < 1e-5, name
        assert rel_err(got[name][1], whole[f"{name}.weight"][0]) < 1e-5, name
        assert rel_err(got[name][0], whole[f"{name}.weight"][0]) > 0.05      # the prompt's loss is left out


def test_query_files_and_refusals(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('"plain"\n{"text": "t"}\n{"prompt": "Where?", "completion": " Here."}\n\n'
                 '{"prompt": "Who?", "answer": " Me.", "context": "Notes."}\n')
    assert read_queries(f) == [Query("plain"), Query("t"), Query("Where?", " Here."), Query("Who?", " Me.", "Notes.")]
    f.write_text('{"prompt": "Where?"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:1: \"prompt\" and \"completion\" must both be strings"):
        read_queries(f)
    encode = TOK.encode
    with pytest.raises(ValueError, match="the answer is empty"):
        Query("a b", "").tokens(encode, eos_token_id=256, max_len=8)
    tokens, first = Query("0123456789", "ab").tokens(encode, eos_token_id=256, max_len=8)
    assert tokens == list(b"456789ab") and first == 6          # the prompt keeps its end
    tokens, first = Query("p", "a", context="xy").tokens(encode, eos_token_id=256, max_len=8)
    assert tokens == [*b"xy", 256, *b"pa"] and first == 4          # context, end-of-text, prompt, answer
    with pytest.raises(ValueError, match="is too short"):
        Query("a").tokens(encode, eos_token_id=256, max_len=8)
    with pytest.raises(ValueError, match="unknown kind of file"):
        list(read_documents(tmp_path / "x.csv"))


def test_prepare_train_attribute_by_source_round_trip(tmp_path, capsys):
    """Three files of the user's own (text, JSONL, Markdown) → ``olmo-tda prepare`` → ``olmo-tda train``
    → ``attribute --group-by source|document``: a query copied from one file's document names that
    file first; documents are listed by their JSONL ids (else ``<file>:<n>``) with their own text."""
    from olmo_tda.cli import main

    rng = np.random.default_rng(1)
    words = ["river", "stone", "lamp", "cloud", "seed", "wire", "bread", "salt"]
    (tmp_path / "notes.txt").write_text("\n\n".join(
        " ".join(rng.choice(words, 8)) + "\nsecond line" for _ in range(40)))
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps({"id": f"fact-{j}", "text": f"{j * 7919 % 1000} is "
                                                             f"{'odd' if j % 2 else 'even'} and 0x{j:04x}"}) + "\n"
                                                  for j in range(60)))
    (tmp_path / "code.md").write_text("\n\n".join(f"def f{j}(x):\n    return x * {j} + {j % 5}" for j in range(50)))
    assert main(["prepare", str(tmp_path / "notes.txt"), str(tmp_path / "facts.jsonl"), str(tmp_path / "code.md"),
                 "--out", str(tmp_path / "data")]) == 0
    printed = capsys.readouterr().out
    assert "  paths: [" in printed and str(tmp_path / "data" / "facts.npy") in printed
    run = tmp_path / "run"
    paths = ",".join(str(tmp_path / "data" / f"{n}.npy") for n in ("notes", "facts", "code"))
    assert main(["-q", "train", str(ROOT / "configs" / "demo_tiny.yaml"), f"--data.paths=[{paths}]",
                 f"--save_folder={run}", "--max_duration=24", "--stop_at=24", "--save_interval_unsharded=24",
                 "--global_train_batch_size=8", "--device_train_microbatch_size=8", "--model.max_sequence_length=32",
                 "--tda.trajectory.enabled=false", "--console_log_interval=1000"]) == 0
    j = 23                                      # document fact-23
    fact = f"{j * 7919 % 1000} is odd and 0x{j:04x}"
    capsys.readouterr()
    assert main(["attribute", str(run), "--query", fact, "--group-by", "source", "--json", str(tmp_path / "s.json")]) == 0
    answer = json.loads((tmp_path / "s.json").read_text())[0]
    assert [r["source"] for r in answer["results"]][0] == "facts"
    assert sorted(r["source"] for r in answer["results"]) == ["code", "facts", "notes"]
    assert all(r["instances"] > 0 for r in answer["results"])
    assert main(["attribute", str(run), "--query", fact, "--group-by", "document", "--top-k", "3",
                 "--json", str(tmp_path / "d.json")]) == 0
    texts = {name or f"{Path(f).stem}:{j}": text for f in ("notes.txt", "facts.jsonl", "code.md")
             for j, (name, text) in enumerate(read_documents(tmp_path / f))}
    top = json.loads((tmp_path / "d.json").read_text())[0]["results"]
    assert len(top) == 3 and all(r["text"] == texts[r["name"]] for r in top), top
    assert all(r["source"] == r["name"].split(":")[0] if ":" in r["name"] else r["source"] == "facts" for r in top)


def test_copies_under_one_name_are_one_document(tmp_path):
    """A document written twice under one id (here once in each of two files) is one document: its
    copies' shares add up (oracle: the per-token brute force, copies mapped to their name)."""
    docs = [{"id": "x", "text": "abcdefghij"}, {"id": "y", "text": "kl"}, {"id": "x", "text": "abcdefghij"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs[:2]))
    (tmp_path / "b.jsonl").write_text(json.dumps(docs[2]) + "\n" + json.dumps({"id": "z", "text": "mnopq"}) + "\n")
    paths = prepare([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "data", encode=TOK.encode,
                    eos_token_id=TOK.eos_token_id)
    corpus = Corpus(paths, seq_len=4, eos_token_id=TOK.eos_token_id, decode=TOK.decode)
    assert corpus.num_documents == 3
    assert [corpus.document_name(d) for d in range(3)] == ["x", "y", "z"]
    ids = np.arange(corpus.num_instances)
    rows, keys, tokens = corpus.documents_of(ids)
    names = {"a": ["x"] * 11 + ["y"] * 3, "b": ["x"] * 11 + ["z"] * 6}     # token -> name, file by file
    want = {}
    for i in ids:
        f, local = ("a", i) if i < 3 else ("b", i - 3)
        for name in names[f][local * 4:(local + 1) * 4]:
            want[(int(i), name)] = want.get((int(i), name), 0) + 1
    got = {}
    for r, k, t in zip(rows, keys, tokens):
        got[(int(ids[r]), corpus.document_name(int(k)))] = got.get((int(ids[r]), corpus.document_name(int(k))), 0) + t
    assert got == want
