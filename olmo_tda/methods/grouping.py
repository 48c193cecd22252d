"""What an answer lists: training rows, examples, documents or sources, and how scores add up to them.

A store row is one example at one step. Grouped answers add row scores up (shapes: Q queries, n
rows in a block, G groups):

- ``example``: an example's score is the sum of its rows' scores over every step it was trained at
  (so an example seen in 40 epochs collects 40 terms; TracIn's in-run and checkpoint variants are
  per example already, their sums lr-weighted).
- ``document``: an instance's score is split among the documents it holds by token share (a
  document holding ``t`` of the instance's ``seq_len`` tokens gets ``t/seq_len`` of it), and a
  document's score is the sum of its shares over the instances it lies in. Splitting keeps the total
  (the sum over documents equals the sum over examples) and does not hand a document the credit
  of the other documents packed beside it.
- ``source``: the sum over the source's examples (a source that is mostly unrelated data sums many
  small scores: compare sources by their top examples as well).
- ``row``: each (example, step) row on its own, as stored.

Example::

    groups = GroupScores(ByExample(), num_queries=2)
    groups.add(torch.tensor([[1., 2., 3.], [0., 1., 0.]], dtype=torch.float64), np.array([7, 7, 9]))
    scores, ids = groups.top(1)          # [[3.], [1.]], [[7], [7]]  (7: 1 + 2 = 3 ties 9: 3; first wins)
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import numpy as np
import torch

from ..data.corpus import Corpus

__all__ = ["GroupBy", "Grouping", "ByExample", "ByDocument", "BySource", "GroupScores"]


class GroupBy(str, Enum):
    ROW = "row"
    EXAMPLE = "example"
    DOCUMENT = "document"
    SOURCE = "source"


class Grouping(Protocol):
    """Maps instance ids to the groups their scores add to."""

    group_by: GroupBy

    def members(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row [m], group [m], weight [m])``: ``weight`` of the score of ``ids[row]`` goes to ``group``."""


class ByExample:
    group_by = GroupBy.EXAMPLE

    def members(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.arange(len(ids)), np.asarray(ids, dtype=np.int64), np.ones(len(ids))


class ByDocument:
    group_by = GroupBy.DOCUMENT

    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def members(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows, docs, tokens = self.corpus.documents_of(ids)
        return rows, docs, tokens / self.corpus.seq_len


class BySource:
    group_by = GroupBy.SOURCE

    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def members(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return np.arange(len(ids)), self.corpus.source_of(ids), np.ones(len(ids))


class GroupScores:
    """Per-query sums of scores by group, ``[Q, G]`` float64 (G grows to the largest group seen)."""

    def __init__(self, grouping: Grouping, num_queries: int):
        self.grouping = grouping
        self.sums = torch.zeros(num_queries, 0, dtype=torch.float64)
        self.seen = np.zeros(0, dtype=bool)

    def add(self, scores: torch.Tensor, ids: np.ndarray) -> None:
        """Add ``scores [Q, n]`` of instances ``ids [n]`` to their groups."""
        rows, groups, weights = self.grouping.members(np.asarray(ids, dtype=np.int64))
        if not len(groups):
            return
        need = int(groups.max()) + 1
        if need > self.sums.shape[1]:
            grow = max(need, 2 * self.sums.shape[1]) - self.sums.shape[1]
            self.sums = torch.cat([self.sums, torch.zeros(self.sums.shape[0], grow, dtype=torch.float64)], 1)
            self.seen = np.concatenate([self.seen, np.zeros(grow, dtype=bool)])
        part = scores.to(torch.float64)[:, torch.from_numpy(rows)] * torch.from_numpy(weights)
        self.sums.index_add_(1, torch.from_numpy(groups), part)
        self.seen[groups] = True

    def top(self, k: int) -> tuple[torch.Tensor, np.ndarray]:
        """``(scores [Q, k'], groups [Q, k'])`` best first, ties to the smaller group id; k' = min(k, groups seen)."""
        have = np.flatnonzero(self.seen)
        sums = self.sums[:, torch.from_numpy(have)]
        key = torch.nan_to_num(sums, nan=-torch.inf)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
        return torch.gather(sums, 1, order), have[order.numpy()]
