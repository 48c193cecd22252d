"""Append-only, crash-safe HDF5 store of per-example compact gradients.

Write (one writer per rank; ``append`` only enqueues, a background thread encodes and writes)::

    import torch
    from olmo_tda.config import StoreConfig
    from olmo_tda.store import GradientRecord, GradientStore

    meta = {"capture": {"proj_dim": 8}, "projector_hash": "demo",
            "layers": [{"name": "fc", "shape": [8, 8], "projector": {"seed": 0}}]}
    with GradientStore.create("/tmp/demo_store", meta, StoreConfig(flush_every=4)) as writer:
        for step in range(10):
            writer.append(GradientRecord(ids=[2 * step, 2 * step + 1], step=step, lr=1e-3,
                                         loss_scale=1.0, grads={"fc": torch.randn(2, 8, 8)}))

Read (streams HDF5 slices; memory bounded by ``block_size``)::

    store = GradientStore.open("/tmp/demo_store")
    print(store.summary())
    for block in store.iter_blocks(block_size=256):
        block.ids, block.steps, block.lr, block.grads["fc"]   # int64 [n], int64 [n], float64 [n], [n, 8, 8]

Where things are: :mod:`.format` (files on disk), :mod:`.meta` (``store.json``), :mod:`.manifest`
(per-rank index, locks, recovery after a crash), :mod:`.keys` (duplicate detection),
:mod:`.writer` (background thread, back-pressure, write errors), :mod:`.reader` (streaming).
"""

from .errors import StoreCorruptError, StoreError, StoreMismatchError, StoreWriteError
from .format import ShardInfo
from .reader import GradientBlock, GradientStore
from .record import GradientRecord
from .writer import NonFiniteGradientWarning, StoreWriter

__all__ = [
    "GradientBlock",
    "GradientRecord",
    "GradientStore",
    "NonFiniteGradientWarning",
    "ShardInfo",
    "StoreCorruptError",
    "StoreError",
    "StoreMismatchError",
    "StoreWriteError",
    "StoreWriter",
]
