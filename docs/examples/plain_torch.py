"""Capture per-example gradients in a plain torch loop, store them, then ask which examples matter."""
import tempfile

import torch
from olmo_tda import CaptureConfig, GradientCapture, GradientStore, StoreConfig, attribute

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
optim = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(256, 16), torch.randint(0, 4, (256,))          # 256 training examples, ids 0..255

capture = GradientCapture(model, CaptureConfig(proj_dim=16, seed=0))  # hooks on both Linear layers
store_dir = tempfile.mkdtemp() + "/store"
with GradientStore.create(store_dir, capture.store_metadata(), StoreConfig(flush_every=4)) as store:
    for step in range(8):
        ids = torch.arange(step * 32, (step + 1) * 32)
        loss = torch.nn.functional.cross_entropy(model(x[ids]), y[ids])  # mean: the loop divides by 32
        with capture.record(ids, loss_scale=len(ids)) as rec:           # ... which capture undoes
            loss.backward()
        optim.step()
        optim.zero_grad()
        store.append(rec.to_record(step=step, lr=0.1))                 # async: off the training step

# query: the gradient of a test example's loss, captured with the same projectors
with capture.record([0]) as rec:
    torch.nn.functional.cross_entropy(model(x[:1] + 0.01), y[:1], reduction="sum").backward()
result = attribute(store_dir, rec.dense(), method="gradcos", top_k=3)
print(result.as_dicts()[0])          # example 0 (the query's near-twin) should rank first
capture.remove()
