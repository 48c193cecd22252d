"""``olmo-tda prepare``: text and JSONL files to OLMo memmap training data with a document index.

Each input file becomes one memmap file (one source, named by the file's stem) in the output folder:
its documents' token ids, each followed by the end-of-text id, as a flat array of ``uint16`` (or
``uint32`` for a vocabulary over 65,536 ids) with no header — what OLMo's ``data.paths`` reads and
cuts into ``max_sequence_length`` instances. Beside it, ``<name>.npy.docs.npz`` records where each
document starts and its name, which answers grouped by document use (:class:`~olmo_tda.data.corpus.Corpus`).

Documents: in ``.jsonl``/``.json`` (one object per line) the ``"text"`` field, named by ``"id"``
when present; in ``.txt``/``.text``/``.md`` blocks separated by blank lines, their own newlines kept.

Example::

    paths = prepare(["facts.jsonl", "notes.txt"], "data", encode=ByteTokenizer().encode, eos_token_id=256)
    # data/facts.npy, data/notes.npy (+ .docs.npz): set data.paths to them
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..config import ConfigError
from .corpus import write_document_index

__all__ = ["prepare", "read_documents", "TEXT_SUFFIXES", "JSONL_SUFFIXES"]

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")


def read_documents(path: str | Path) -> Iterator[tuple[str | None, str]]:
    """``(name or None, text)`` of each document of a text or JSONL file (see the module docstring)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
        raise ConfigError(f"{path}: unknown kind of file {suffix!r}; give text ({', '.join(TEXT_SUFFIXES)}: "
                          f"documents separated by blank lines) or JSONL ({', '.join(JSONL_SUFFIXES)}: a \"text\" "
                          "field per line)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None
    if suffix in TEXT_SUFFIXES:
        for block in re.split(r"\n[ \t]*\n", text):
            if block.strip():
                yield None, block.strip("\n")
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e}); expected an object with a \"text\" field") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise ConfigError(f"{path}:{n}: expected an object with a string \"text\" field")
        name = item.get("id")
        yield (None if name is None else str(name)), item["text"]


def prepare(inputs: Sequence[str | Path], out_dir: str | Path, *, encode: Callable[[str], list[int]],
            eos_token_id: int, vocab_size: int = 65536) -> list[Path]:
    """Write one memmap file (and its document index) per input file into ``out_dir``; returns the
    memmap paths in input order (the order to give ``data.paths``). A name used twice is refused."""
    out = Path(out_dir)
    stems = [Path(p).stem for p in inputs]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:
        raise ConfigError(f"inputs {twice} share a file name: each input becomes one source named by its stem")
    if not inputs:
        raise ConfigError("give at least one text or JSONL file")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path, stem in zip(inputs, stems):
        pieces, starts, names, at = [], [], [], 0
        for j, (name, text) in enumerate(read_documents(path)):
            ids = list(encode(text)) + [eos_token_id]
            if max(ids) >= vocab_size or min(ids) < 0:
                raise ConfigError(f"{path}: document {j} encodes to ids outside [0, {vocab_size})")
            pieces.append(np.asarray(ids, dtype=dtype))
            starts.append(at)
            names.append(name if name is not None else f"{stem}:{j}")
            at += len(ids)
        if not pieces:
            raise ConfigError(f"{path}: no documents in it")
        target = out / f"{stem}.npy"
        tmp = target.with_name(target.name + ".tmp")
        np.concatenate(pieces).tofile(tmp)
        tmp.replace(target)
        write_document_index(target, np.asarray(starts), names)
        written.append(target)
    return written
