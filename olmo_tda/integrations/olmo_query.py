"""Ask an OLMo run which training passages made it produce a text (``olmo-tda attribute RUN``).

A run directory written by ``olmo-tda train`` holds everything needed: OLMo's ``config.yaml`` (model,
tokenizer, data paths), ``tda.yaml`` (the capture config, hence the projectors), the latest
unsharded checkpoint (weights, read with ``weights_only=True``), the gradient store, and the
memmap training data to decode passages by their global index.

Example::

    from olmo_tda.integrations.olmo_query import OLMoRun
    run = OLMoRun("demo_out/run")
    answers = run.attribute(["The for statement is used to iterate"], method="gradcos", top_k=5)
    print(answers[0]["results"][0])        # {"index": ..., "step": ..., "score": ..., "text": ...}
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import yaml

from ..capture import GradientCapture
from ..config import TDAConfig
from ..demo.corpus import ByteTokenizer
from ..demo.data import BYTE_TOKENIZER_ID
from ..methods import attribute
from ..store import GradientStore
from .olmo import TDA_YAML

__all__ = ["OLMoRun"]

log = logging.getLogger(__name__)


class OLMoRun:
    """A finished (or checkpointed) ``olmo-tda train`` run, opened for queries."""

    def __init__(self, run_dir: str | Path, checkpoint: str | Path | None = None):
        from olmo.config import TrainConfig
        from olmo.model import OLMo

        self.dir = Path(run_dir)
        for needed in ("config.yaml", TDA_YAML):
            if not (self.dir / needed).is_file():
                raise FileNotFoundError(f"{self.dir} is not an olmo-tda run directory (no {needed})")
        self.cfg = TrainConfig.load(self.dir / "config.yaml", validate_paths=False)
        self.tda = TDAConfig.from_dict((yaml.safe_load((self.dir / TDA_YAML).read_text()) or {}).get("tda"))
        self.store = GradientStore.open(Path(self.tda.store.path or self.dir / "tda" / "store"))
        ckpt = Path(checkpoint) if checkpoint else self._latest_checkpoint()
        self.cfg.model.init_device = "cpu"
        self.model = OLMo(self.cfg.model)
        self.model.load_state_dict(torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True))
        self.model.eval()
        self.checkpoint = ckpt
        self.tokenizer = self._tokenizer()
        self._dataset = None

    def _latest_checkpoint(self) -> Path:
        found = sorted(self.dir.glob("step*-unsharded"), key=lambda p: int(p.name[4:].split("-")[0]))
        if not found:
            raise FileNotFoundError(f"{self.dir} has no unsharded checkpoint (stepN-unsharded/model.pt) to "
                                    "compute query gradients with; set save_interval_unsharded in the run")
        return found[-1]

    def _tokenizer(self):
        if self.cfg.tokenizer.identifier == BYTE_TOKENIZER_ID:
            return ByteTokenizer()
        from olmo.tokenizer import Tokenizer
        return Tokenizer.from_train_config(self.cfg)

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False) if not isinstance(
            self.tokenizer, ByteTokenizer) else self.tokenizer.encode(text)
        return ids[: self.cfg.model.max_sequence_length]

    def passage(self, index: int) -> str:
        """Decoded text of training instance ``index`` (OLMo's global instance id)."""
        if self._dataset is None:
            from olmo.data import build_memmap_dataset
            self._dataset = build_memmap_dataset(self.cfg, self.cfg.data)
        return self.tokenizer.decode(self._dataset[int(index)]["input_ids"].tolist())

    def query_gradients(self, texts: list[str]) -> tuple[dict[str, torch.Tensor], str]:
        """Projected gradients ``{layer: [Q, Ko, Ki]}`` of each text's summed token loss, at the
        checkpoint's weights, through projectors identical to the store's (their hash is returned)."""
        capture = GradientCapture(self.model, self.tda.capture)
        try:
            grads: dict[str, list[torch.Tensor]] = {}
            for text in texts:
                tokens = torch.tensor([self._encode(text)])
                if tokens.shape[1] < 2:
                    raise ValueError(f"query {text!r} is too short: it needs at least 2 tokens")
                with capture.record([0]) as rec:
                    logits = self.model(tokens).logits
                    torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:], reduction="sum").backward()
                self.model.zero_grad(set_to_none=True)
                for name, g in rec.dense().items():
                    grads.setdefault(name, []).append(g)
            return {n: torch.cat(gs) for n, gs in grads.items()}, capture.projector_hash
        finally:
            capture.remove()

    def attribute(self, texts: list[str], *, method: str = "gradcos", top_k: int = 10) -> list[dict[str, Any]]:
        """``[{"query", "results": [{"index", "step", "score", "text"}, ...]}, ...]`` best first."""
        queries, projector_hash = self.query_gradients(texts)
        result = attribute(self.store, queries, method=method, top_k=top_k, projector_hash=projector_hash)
        out = []
        for text, rows in zip(texts, result.as_dicts()):
            for row in rows:
                row["text"] = self.passage(row["index"])
            out.append({"query": text, "results": rows})
        return out
