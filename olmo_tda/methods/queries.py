"""Queries: a text, or a prompt with the answer it should lead to, and their projected gradients.

A plain text query's gradient is that of its summed next-token loss (every token after the first).
A prompt → answer query (``Query(prompt, completion)``) scores the completion's tokens only: the
prompt is context, so "which data taught the model to answer this?" is not drowned by the words of
the question. Such a query starts with the end-of-text id, as every training document after the
first follows one, so the prompt's first token is read where training put it; a ``context`` goes
before that id, as the end of the document packed before it (small models trained on packed
documents rarely see one start at position 0, and answer better after some text).

Example::

    q = Query("Where was Ada Brell born?", " In Tulsa.")
    tokens, first = q.tokens(encode, eos_token_id=0, max_len=128)
    grads = query_gradients(model, capture, [(tokens, first)])      # {layer: [1, Ko, Ki]}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config import ConfigError

__all__ = ["Query", "read_queries", "query_gradients"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Query:
    """A text (``completion`` None: every token is scored) or a prompt and its completion, optionally
    after a ``context`` (unscored text before the end-of-text id that starts the prompt)."""

    prompt: str
    completion: str | None = None
    context: str | None = None

    @property
    def text(self) -> str:
        return self.prompt if self.completion is None else self.prompt + self.completion

    def tokens(self, encode: Callable[[str], list[int]], *, eos_token_id: int, max_len: int
               ) -> tuple[list[int], int]:
        """``(token ids, first scored position)``: the loss is the sum of the next-token losses of the
        tokens at positions ``>= first``. Too long for ``max_len``: a text keeps its first tokens, a
        prompt → answer query its whole completion and the end of its prompt (warned)."""
        if self.completion is None:
            ids = encode(self.prompt)
            if len(ids) > max_len:
                log.warning("query %s is %d tokens: only its first %d (the model's max_sequence_length) are "
                            "scored", _short(self.prompt), len(ids), max_len)
            ids = ids[:max_len]
            if len(ids) < 2:
                raise ConfigError(f"query {self.prompt!r} is too short: it needs at least 2 tokens")
            return ids, 1
        context = list(encode(self.context)) if self.context else []
        prompt, answer = [*context, eos_token_id, *encode(self.prompt)], encode(self.completion)
        if not answer:
            raise ConfigError(f"query {self.prompt!r}: the answer is empty (give the tokens to score)")
        if len(answer) >= max_len:
            raise ConfigError(f"query {self.prompt!r}: the answer is {len(answer)} tokens; the model reads at "
                              f"most {max_len} (max_sequence_length), prompt included")
        if len(prompt) + len(answer) > max_len:
            log.warning("query %s: context, prompt and answer are %d tokens; the answer is kept with the last "
                        "%d before it", _short(self.prompt), len(prompt) + len(answer), max_len - len(answer))
            prompt = prompt[len(prompt) + len(answer) - max_len:]
        return prompt + answer, len(prompt)


def read_queries(path: str | Path) -> list[Query]:
    """A JSONL file: per line a string, ``{"text": ...}`` (or ``"query"``), or ``{"prompt", "completion"}``
    (``"answer"`` is accepted for ``"completion"``; an optional ``"context"`` goes before the prompt)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"--query-file {path}: not UTF-8 text ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e}); expected a string, {{\"text\": ...}} or "
                              "{\"prompt\": ..., \"completion\": ...} per line") from None
        out.append(_query(item, f"{path}:{n}"))
    return out


def _query(item: Any, where: str) -> Query:
    if isinstance(item, str):
        return Query(item)
    if isinstance(item, dict):
        completion = item.get("completion", item.get("answer"))
        if "prompt" in item or completion is not None:
            if not isinstance(item.get("prompt"), str) or not isinstance(completion, str):
                raise ConfigError(f"{where}: \"prompt\" and \"completion\" must both be strings")
            if not isinstance(item.get("context", ""), str):
                raise ConfigError(f"{where}: \"context\" must be a string")
            return Query(item["prompt"], completion, item.get("context") or None)
        text = item.get("text", item.get("query"))
        if isinstance(text, str):
            return Query(text)
    raise ConfigError(f"{where}: expected a string, {{\"text\": ...}} or {{\"prompt\": ..., \"completion\": ...}}")


def query_gradients(model: torch.nn.Module, capture: Any, items: Sequence[tuple[Sequence[int], int]], *,
                    logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
                    store: Any = None) -> dict[str, torch.Tensor]:
    """Projected gradients ``{layer: [Q, Ko, Ki]}`` of each item's loss through ``capture`` (a
    :class:`~olmo_tda.capture.GradientCapture` on ``model``).

    ``items``: ``(token ids, first)`` per query; its loss is ``Σ_{t >= first} -log p(x_t | x_<t)``
    (``first = 1``: every token's). ``logits(model, ids [1, T]) -> [1, T, V]`` (default
    ``model(ids).logits``). The model's parameter gradients are left cleared.

    ``store``: when its rows were projected with several eigenbasis versions (``store.bases``, a
    basis that follows the run), the queries are projected with each (one backward per version;
    ``capture`` is left on the last) and a :class:`~olmo_tda.methods.base.BasisQueries` is returned.
    """
    versions = list(getattr(store, "bases", None) or [])
    if versions:
        from .base import BasisQueries, ProjectedQueries

        out = BasisQueries()
        for digest in versions:
            capture.use_basis(store.load_basis(digest))
            out[digest] = ProjectedQueries(query_gradients(model, capture, items, logits=logits), digest)
        return out
    from ..capture import activation_grads_only

    forward = logits or (lambda m, ids: m(ids).logits)
    grads: dict[str, list[torch.Tensor]] = {}
    with activation_grads_only(model):
        for ids, first in items:
            if not 1 <= first < len(ids):
                raise ConfigError(f"first scored position {first} must lie in [1, {len(ids)})")
            tokens = torch.tensor([list(ids)], dtype=torch.long)
            with capture.record([0]) as rec:
                out = forward(model, tokens)
                torch.nn.functional.cross_entropy(out[0, first - 1:-1].float(), tokens[0, first:],
                                                  reduction="sum").backward()
            model.zero_grad(set_to_none=True)
            for name, g in rec.dense().items():
                grads.setdefault(name, []).append(g)
    return {n: torch.cat(gs) for n, gs in grads.items()}


def _short(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")
