"""A real-text corpus that ships with every CPython, and a tokenizer that needs no download.

The text is Python's own reference documentation (``pydoc_data.topics``) and the docstrings of a
fixed list of standard-library modules: English prose mixed with code, the same on every machine
with the same Python. Tokens are UTF-8 bytes (ids 0-255) plus an end-of-text id.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import warnings

import numpy as np

from ..config import ConfigError

__all__ = ["ByteTokenizer", "build_passages", "corpus_fingerprint"]

_DOC_MODULES = ["collections", "functools", "itertools", "json", "pathlib", "re", "string", "textwrap",
                "typing", "argparse", "logging", "dataclasses", "datetime", "decimal", "fractions",
                "statistics", "heapq", "bisect", "csv", "difflib", "shutil", "tempfile", "threading",
                "subprocess", "unittest", "contextlib", "enum", "abc", "random", "math"]


class ByteTokenizer:
    """UTF-8 bytes as token ids; ``eos_token_id = 256``; vocabulary 257."""

    eos_token_id = 256
    pad_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _texts() -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    with warnings.catch_warnings():       # touching deprecated aliases (typing.re) warns
        warnings.simplefilter("ignore", DeprecationWarning)
        texts += _docstrings()
    return texts


def _docstrings() -> list[str]:
    texts = []
    for name in _DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:       # a trimmed Python may lack one; the corpus just gets smaller
            continue
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
            if doc and len(doc) > 80 and getattr(obj, "__module__", "") == name:
                texts.append(doc)
    return texts


def build_passages(num_passages: int, seq_len: int, seed: int = 0) -> list[str]:
    """``num_passages`` distinct passages of exactly ``seq_len`` bytes (whitespace normalized).

    Passages are consecutive windows of the concatenated corpus, so each is real running text; a
    seeded shuffle picks which ones are used.
    """
    # The docs repeat whole sentences across topics; keep each sentence once so that no two
    # passages are near-copies (a self-query's best match must be itself, not its twin).
    seen: set[str] = set()
    sentences = []
    for sentence in re.split(r"(?<=[.!?]) ", " ".join(re.sub(r"\s+", " ", t).strip() for t in _texts())):
        key = sentence.strip().lower()
        if len(key) < 24 or key not in seen:
            seen.add(key)
            sentences.append(sentence)
    data = " ".join(sentences).encode("ascii", errors="ignore")
    starts = np.arange(0, len(data) - seq_len, seq_len)
    if len(starts) < num_passages:
        raise ConfigError(f"the shipped corpus has {len(starts)} passages of {seq_len} bytes; asked for {num_passages}")
    chosen = np.random.default_rng(seed).choice(starts, size=num_passages, replace=False)
    return [data[s:s + seq_len].decode("ascii") for s in chosen]


def corpus_fingerprint(passages: list[str]) -> str:
    return hashlib.sha256("\x00".join(passages).encode()).hexdigest()[:16]
