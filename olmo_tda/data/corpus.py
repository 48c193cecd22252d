"""The training data as answers name it: instances, documents and sources of OLMo memmap files.

OLMo reads each memmap file (a flat array of token ids) as consecutive instances of exactly
``seq_len`` tokens (a tail shorter than that is never trained on), and numbers instances globally,
file after file, in the order of ``data.paths`` (or of ``data.datasets``' sorted labels). A
**document** is a run of tokens ending with the end-of-text id (the last one may run to the file's
end); an instance may hold several documents, and a long document spans several instances. A
**source** is one file, named by its ``data.datasets`` label or else its file name's stem.

Where ``olmo-tda prepare`` wrote the file, a ``<file>.docs.npz`` beside it holds each document's
first token and its name (a JSONL ``"id"``, else ``<source>:<n>``); other files are split at their
end-of-text tokens, read once and kept in memory (8 bytes per document). Copies of a document under
one name (the same JSONL ``"id"`` written twice, in one file or several) are one document: answers
add up their copies' scores and name it once.

Example::

    corpus = Corpus(["data/facts.npy", "data/code.npy"], seq_len=128, eos_token_id=0)
    corpus.source_of(np.array([0, 5000]))      # source index of instances 0 and 5000
    corpus.document_text(3)                    # the 4th document's text (with a tokenizer)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..config import ConfigError

__all__ = ["Corpus", "DOCS_SUFFIX", "write_document_index"]

log = logging.getLogger(__name__)

DOCS_SUFFIX = ".docs.npz"
"""The document index ``olmo-tda prepare`` writes beside each memmap file (numpy arrays, no pickle)."""


def write_document_index(memmap: str | Path, starts: np.ndarray, names: Sequence[str]) -> Path:
    """Write ``<memmap>.docs.npz``: document ``j`` starts at token ``starts[j]`` and is called ``names[j]``."""
    path = Path(str(memmap) + DOCS_SUFFIX)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, starts=np.asarray(starts, dtype=np.int64), names=np.asarray(list(names), dtype=str))
    tmp.replace(path)
    return path


@dataclass
class _File:
    path: Path
    source: int
    first_instance: int
    num_instances: int
    tokens: int
    first_doc: int = 0
    starts: np.ndarray | None = None    # [docs] first token of each document in this file
    names: np.ndarray | None = None     # [docs] str, from the prepare index


class Corpus:
    """Instances, documents and sources of OLMo memmap files (see the module docstring). Instances
    and sources cost nothing but the files' sizes; documents are read on first use.

    Args:
        paths: the memmap files, in OLMo's order.
        labels: each file's source name (default: its stem; ``data.datasets`` labels where given).
        seq_len: the model's ``max_sequence_length`` (tokens per instance).
        dtype: the memmap's token dtype (OLMo's ``data.effective_memmap_dtype``).
        eos_token_id: the id that ends a document.
        decode: token ids -> text, for :meth:`document_text`.
    """

    def __init__(self, paths: Sequence[str | Path], *, seq_len: int, eos_token_id: int,
                 labels: Sequence[str] | None = None, dtype: Any = np.uint16,
                 decode: Callable[[list[int]], str] | None = None):
        if not paths:
            raise ConfigError("a corpus needs at least one memmap file")
        if labels is not None and len(labels) != len(paths):
            raise ConfigError(f"{len(labels)} labels for {len(paths)} memmap files")
        self.seq_len, self.eos, self.dtype, self.decode = int(seq_len), int(eos_token_id), np.dtype(dtype), decode
        names = list(labels) if labels is not None else [Path(str(p)).stem for p in paths]
        self.sources: list[str] = list(dict.fromkeys(names))
        self.files: list[_File] = []
        instance = 0
        for path, name in zip(paths, names):
            path = Path(str(path))
            if not path.is_file():
                raise FileNotFoundError(f"training data file {path} is missing: answers decode passages from it")
            tokens = path.stat().st_size // self.dtype.itemsize
            num = tokens // self.seq_len
            self.files.append(_File(path, self.sources.index(name), instance, num, tokens))
            instance += num
        self.num_instances = instance
        self._instance_starts = np.array([f.first_instance for f in self.files], dtype=np.int64)
        self._doc_tables: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def num_documents(self) -> int:
        """Distinct documents (copies under one name counted once)."""
        return len(self._documents_index()[2])

    def _documents_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first span of each file, key of each span, first span of each key)``, built once: every
        file's document starts (its prepare index, else its end-of-text tokens) and one key per name
        (copies under one name share it; unnamed spans are their own)."""
        if self._doc_tables is None:
            span = 0
            for f in self.files:
                f.starts, f.names = self._documents(f.path, f.tokens)
                f.first_doc, span = span, span + len(f.starts)
            keys, first, seen = np.empty(span, dtype=np.int64), [], {}
            for f in self.files:
                if f.names is None:
                    keys[f.first_doc:f.first_doc + len(f.starts)] = np.arange(len(first), len(first) + len(f.starts))
                    first.extend(range(f.first_doc, f.first_doc + len(f.starts)))
                    continue
                for j, name in enumerate(f.names.tolist()):
                    key = seen.get(name)
                    if key is None:
                        key = seen[name] = len(first)
                        first.append(f.first_doc + j)
                    keys[f.first_doc + j] = key
            self._doc_tables = (np.array([f.first_doc for f in self.files], dtype=np.int64), keys,
                                np.asarray(first, dtype=np.int64))
        return self._doc_tables

    def _documents(self, path: Path, tokens: int) -> tuple[np.ndarray, np.ndarray | None]:
        index = Path(str(path) + DOCS_SUFFIX)
        if index.is_file():
            try:
                with np.load(index, allow_pickle=False) as saved:
                    starts, names = saved["starts"].astype(np.int64), saved["names"]
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{index}: not a readable document index ({e}); run `olmo-tda prepare` again "
                                  "or delete it (documents are then split at end-of-text tokens)") from None
            if (len(starts) != len(names) or not len(starts) or starts[0] != 0 or (np.diff(starts) <= 0).any()
                    or starts[-1] >= max(tokens, 1)):
                raise ConfigError(f"{index} does not describe {path} ({tokens} tokens): its document starts are "
                                  "not increasing from 0 inside the file; run `olmo-tda prepare` again")
            return starts, names
        data = np.memmap(path, dtype=self.dtype, mode="r", shape=(tokens,)) if tokens else np.zeros(0, self.dtype)
        ends = [np.flatnonzero(data[lo:lo + (1 << 24)] == self.eos) + lo for lo in range(0, tokens, 1 << 24)]
        starts = np.concatenate([np.zeros(1, np.int64), *(e.astype(np.int64) + 1 for e in ends)])
        return starts[starts < max(tokens, 1)], None

    # -- instances -> files, documents, sources ---------------------------------------------------

    def _file_of(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise ConfigError(f"instance ids must lie in [0, {self.num_instances}); got {ids.min()}..{ids.max()}")
        return np.searchsorted(self._instance_starts, ids, side="right") - 1

    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """``[n]`` the source index (into :attr:`sources`) of each instance."""
        return np.array([self.files[f].source for f in self._file_of(ids)], dtype=np.int64)

    def documents_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The documents each instance holds: ``(row [m], document [m], tokens [m])`` — instance
        ``ids[row]`` holds ``tokens`` of its ``seq_len`` tokens from document ``document`` (an instance
        holding two copies of one document lists it twice)."""
        ids = np.asarray(ids, dtype=np.int64)
        _, key_of_span, _ = self._documents_index()
        rows, docs, counts = [], [], []
        files = self._file_of(ids)
        for f in np.unique(files):
            info = self.files[f]
            sel = np.flatnonzero(files == f)
            lo = (ids[sel] - info.first_instance) * self.seq_len          # first token of each instance
            first = np.searchsorted(info.starts, lo, side="right") - 1
            last = np.searchsorted(info.starts, lo + self.seq_len - 1, side="right") - 1
            span = last - first + 1
            row = np.repeat(sel, span)
            doc = np.repeat(first, span) + (np.arange(span.sum()) - np.repeat(np.cumsum(span) - span, span))
            start = np.maximum(info.starts[doc], np.repeat(lo, span))
            ends = np.append(info.starts[1:], np.iinfo(np.int64).max)[doc]
            stop = np.minimum(ends, np.repeat(lo + self.seq_len, span))
            rows.append(row)
            docs.append(key_of_span[doc + info.first_doc])
            counts.append(stop - start)
        if not rows:
            return (np.zeros(0, np.int64),) * 3
        return np.concatenate(rows), np.concatenate(docs), np.concatenate(counts)

    # -- documents: names, text -------------------------------------------------------------------

    def _doc_file(self, doc: int) -> tuple[_File, int]:
        """The file and local index of document ``doc``'s first copy."""
        doc_starts, _, first_span = self._documents_index()
        if not 0 <= doc < len(first_span):
            raise ConfigError(f"document {doc} is not in [0, {len(first_span)})")
        span = int(first_span[doc])
        f = self.files[int(np.searchsorted(doc_starts, span, side="right") - 1)]
        return f, span - f.first_doc

    def document_name(self, doc: int) -> str:
        f, j = self._doc_file(doc)
        return str(f.names[j]) if f.names is not None else f"{self.sources[f.source]}:{j}"

    def document_source(self, doc: int) -> str:
        return self.sources[self._doc_file(doc)[0].source]

    def document_tokens(self, doc: int) -> np.ndarray:
        """Token ids of document ``doc``'s first copy (its end-of-text id included where it has one)."""
        f, j = self._doc_file(doc)
        lo, hi = int(f.starts[j]), int(f.starts[j + 1]) if j + 1 < len(f.starts) else f.tokens
        return np.asarray(np.memmap(f.path, dtype=self.dtype, mode="r", shape=(f.tokens,))[lo:hi])

    def document_text(self, doc: int) -> str:
        if self.decode is None:
            raise ConfigError("this corpus has no tokenizer to decode documents with (decode=...)")
        return self.decode([int(t) for t in self.document_tokens(doc) if int(t) != self.eos])

    def source_instances(self) -> np.ndarray:
        """``[sources]`` instances per source."""
        out = np.zeros(len(self.sources), dtype=np.int64)
        for f in self.files:
            out[f.source] += f.num_instances
        return out
