"""Write passages as OLMo memmap training data: one instance per passage, exactly seq_len tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import ConfigError
from .corpus import ByteTokenizer

__all__ = ["write_memmap", "BYTE_TOKENIZER_ID"]

BYTE_TOKENIZER_ID = "olmo_tda:bytes"
"""``tokenizer.identifier`` naming the byte tokenizer (no download); OLMo only uses it for eval/generation."""


def write_memmap(passages: list[str], path: str | Path, seq_len: int) -> Path:
    """Concatenate the byte tokens of ``passages`` (each exactly ``seq_len``) as uint16 raw memmap.

    OLMo's MemMapDataset chunks the flat array into ``seq_len`` instances, so instance ``i`` is
    passage ``i``. A ``passages.jsonl`` sidecar keeps the text for reports.
    """
    tok = ByteTokenizer()
    tokens = np.array([tok.encode(p) for p in passages], dtype=np.uint16)
    if tokens.ndim != 2 or tokens.shape[1] != seq_len:
        raise ConfigError(f"every passage must be exactly {seq_len} tokens")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mm = np.memmap(path, dtype=np.uint16, mode="w+", shape=tokens.size)
    mm[:] = tokens.reshape(-1)
    mm.flush()
    del mm
    (path.parent / "passages.jsonl").write_text("".join(json.dumps({"index": i, "text": p}) + "\n"
                                                       for i, p in enumerate(passages)))
    return path
