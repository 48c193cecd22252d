"""Capture never changes training: identical losses and weights with it on or off, even when the
store fails mid-run (the error surfaces in the training thread; the model is untouched)."""

from __future__ import annotations

import pytest
import torch

from olmo_tda import CaptureConfig, GradientCapture, GradientStore, StoreConfig
from olmo_tda.store import StoreWriteError
from conftest import tiny_olmo, token_losses


def _train(steps, capture_cfg=None, store_dir=None, break_store_at=None, device="cpu"):
    model = tiny_olmo().to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    cap = GradientCapture(model, capture_cfg) if capture_cfg else None
    store = GradientStore.create(store_dir, cap.store_metadata(), StoreConfig(flush_every=1)) if store_dir else None
    losses, errors = [], []
    for step in range(steps):
        batch = torch.randint(0, 96, (4, 12), generator=gen).to(device)
        loss = token_losses(model(batch).logits, batch).sum() / batch.numel()
        if cap is None:
            loss.backward()
        else:
            with cap.record(range(step * 4, step * 4 + 4), loss_scale=batch.numel()) as rec:
                loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if store is not None:
            if step == break_store_at:
                (store.path / "shards").rename(store.path / "away")   # the disk "goes away" under the writer
            try:
                store.append(rec.to_record(step=step, lr=1e-2))
                if step == break_store_at:
                    store.flush()
            except StoreWriteError as e:
                errors.append(str(e))
    if store is not None:
        try:
            store.close()
        except StoreWriteError as e:
            errors.append(str(e))
            (store.path / "away").rename(store.path / "shards")   # the disk comes back: retry the close
            store.close()
    return losses, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, errors


def test_capture_on_off_identical_losses_and_weights(tmp_path):
    plain_losses, plain_w, _ = _train(6)
    cap_losses, cap_w, errors = _train(6, CaptureConfig(proj_dim=8), tmp_path / "store")
    assert errors == []
    assert plain_losses == cap_losses                      # bitwise: same floats
    assert all(torch.equal(plain_w[k], cap_w[k]) for k in plain_w)
    assert GradientStore.open(tmp_path / "store").num_rows == 24


def test_store_failure_mid_run_is_reported_and_training_is_not_corrupted(tmp_path):
    plain_losses, plain_w, _ = _train(6)
    losses, weights, errors = _train(6, CaptureConfig(proj_dim=8), tmp_path / "store", break_store_at=3)
    assert errors and "gradient store" in errors[0] and str(tmp_path / "store") in errors[0]
    assert losses == plain_losses and all(torch.equal(plain_w[k], weights[k]) for k in plain_w)
    # the failed windows stayed in memory and were written once the directory came back: no row lost
    store = GradientStore.open(tmp_path / "store", repair=True)
    assert store.steps.tolist() == [0, 1, 2, 3, 4, 5] and store.num_rows == 24


@pytest.mark.gpu
def test_cuda_capture_equals_cpu_capture():
    """Projectors are drawn on CPU and moved: the CUDA path gives the CPU numbers (fp32 matmul tol)."""
    ids = torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    out = {}
    for device in ("cpu", "cuda"):
        model = tiny_olmo().to(device)
        cap = GradientCapture(model, CaptureConfig(proj_dim=16))
        with cap.record(range(3)) as rec:
            token_losses(model(ids.to(device)).logits, ids.to(device)).sum().backward()
        out[device] = {k: v.cpu() for k, v in rec.dense().items()}
    for name, g in out["cpu"].items():
        assert torch.allclose(out["cuda"][name], g, rtol=1e-3, atol=1e-4 * g.abs().max().item()), name
