"""The one workload every system in the peers benchmark runs: model, data, loss, and ground truth.

This module imports only torch and numpy, because it runs inside every peer's own venv, next to that
peer, where olmo_tda is not installed.

- Model (``Workload.arch``): ``"linear"``, a small causal LM made only of plain ``nn.Linear`` layers
  (bias-free, so no library's bias convention matters), with token and position embeddings,
  LayerNorm, and causal attention; or ``"olmo"``, ai2-olmo's own ``OLMo`` at the same size (RoPE,
  SwiGLU, fused QKV, SDPA attention, untied bias-free head), wrapped to return logits.
- Scored layers: every ``nn.Linear`` weight. These are the layers all five peers can hook.
- ``"olmo"`` imports ai2-olmo. A peer's venv does not have it: the orchestrator installs ai2-olmo and
  its import-time dependencies once into a separate folder (``venvs.olmo_lib``) and names it in
  ``OLMO_TDA_PEERS_OLMO_LIB``; it is appended to the end of ``sys.path``, so every package the peer
  installed itself still wins.
- Loss: next-token cross-entropy summed over the positions of an example. Each example's gradient
  is the gradient of its own summed loss.
- Data: byte-level passages of real text. The orchestrator cuts them once and saves them, so every
  process reads the same tensors.
- Ground truth: exact per-example gradients from ``torch.func.vmap(grad)`` over the scored weights,
  and their dot products.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Workload:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    seq_len: int = 64
    n_train: int = 1024
    n_query: int = 16
    batch: int = 16
    k: int = 8
    """Projection width per side of each layer: every system stores k·k = 64 floats per layer."""
    damping: float = 1e-3
    warmup_steps: int = 150
    seed: int = 0
    arch: str = "linear"
    """``"linear"`` (``TinyLM``) or ``"olmo"`` (``OLMoLM``: ai2-olmo's model)."""
    device: str = "cpu"
    """Where the model, the data and the exact ground truth live (``"cuda"``: every system but
    olmo_tda's unprojected row runs there, each adapter placing its work on the model's device)."""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "Workload":
        return cls(**json.loads(path.read_text()))


class Block(nn.Module):
    def __init__(self, w: Workload):
        super().__init__()
        d = w.d_model
        self.heads = w.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, w.mlp_ratio * d, bias=False)
        self.down = nn.Linear(w.mlp_ratio * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        # explicit causal attention: SDPA has no vmap batching rule on CPU (TRAK and the exact
        # gradients run under torch.func.vmap)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        a = att.softmax(dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, w: Workload):
        super().__init__()
        self.wte = nn.Embedding(w.vocab, w.d_model)
        self.wpe = nn.Embedding(w.seq_len, w.d_model)
        self.blocks = nn.ModuleList(Block(w) for _ in range(w.n_layers))
        self.ln_f = nn.LayerNorm(w.d_model)
        self.head = nn.Linear(w.d_model, w.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


OLMO_LIB_ENV = "OLMO_TDA_PEERS_OLMO_LIB"
ARCHS = ("linear", "olmo")


def _olmo():
    """``(OLMo, ModelConfig)``; where this venv lacks ai2-olmo, from the folder ``OLMO_LIB_ENV`` names
    (appended last to ``sys.path``: the venv's own packages keep priority)."""
    try:
        from olmo.config import ModelConfig
        from olmo.model import OLMo
    except ImportError as exc:
        import sys

        lib = os.environ.get(OLMO_LIB_ENV)
        if not lib or lib in sys.path:
            raise ImportError(f"arch 'olmo' needs ai2-olmo: not importable here ({exc}) and "
                              f"{OLMO_LIB_ENV} names no folder that has it") from exc
        sys.path.append(lib)
        from olmo.config import ModelConfig
        from olmo.model import OLMo
    return OLMo, ModelConfig


class OLMoLM(nn.Module):
    """ai2-olmo's ``OLMo`` at the workload's size, returning logits like ``TinyLM``: untied head (so
    it is an ``nn.Linear`` every peer can hook), bias-free, no dropout, RoPE, byte vocabulary."""

    def __init__(self, w: Workload):
        super().__init__()
        OLMo, ModelConfig = _olmo()
        cfg = ModelConfig(d_model=w.d_model, n_heads=w.n_heads, n_layers=w.n_layers, mlp_ratio=w.mlp_ratio,
                          vocab_size=w.vocab, embedding_size=w.vocab, eos_token_id=0, pad_token_id=0,
                          max_sequence_length=w.seq_len, rope=True, weight_tying=False, include_bias=False,
                          attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0,
                          init_device="cpu", init_fn="normal")
        self.model = OLMo(cfg)
        self.model.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).logits


def build_model(w: Workload) -> nn.Module:
    if w.arch not in ARCHS:
        raise ValueError(f"unknown workload arch {w.arch!r}; known: {', '.join(ARCHS)}")
    return OLMoLM(w) if w.arch == "olmo" else TinyLM(w)


def linear_names(model: nn.Module) -> list[str]:
    """The scored layers, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def example_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B] next-token cross-entropy summed over each example's positions."""
    v = logits.shape[-1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, v), input_ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(input_ids.shape[0], -1).sum(dim=1)


# ---------------------------------------------------------------------------------------------------
# workdir: the orchestrator writes it once; every process reads it


def load(workdir: Path) -> tuple[Workload, nn.Module, torch.Tensor, torch.Tensor]:
    """(workload, model at the trained checkpoint in eval mode, train ids [N, T], query ids [Q, T])."""
    w = Workload.load(workdir / "workload.json")
    data = torch.load(workdir / "data.pt", weights_only=True)
    model = build_model(w)
    model.load_state_dict(torch.load(workdir / "model.pt", weights_only=True))
    model.to(w.device).eval()
    return w, model, data["train"].to(w.device), data["query"].to(w.device)


def text_passages(seq_len: int, count: int, seed: int) -> torch.Tensor:
    """``count`` byte passages of ``seq_len`` from this Python's own standard-library sources
    (the same files on every machine with this interpreter; no download)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    blob = b"\n".join(p.read_bytes() for p in files)
    rng = np.random.default_rng(seed)
    starts = rng.choice(len(blob) - seq_len, size=count, replace=False)
    arr = np.frombuffer(blob, dtype=np.uint8)
    return torch.from_numpy(np.stack([arr[s:s + seq_len] for s in starts]).astype(np.int64))


def prepare(workdir: Path, w: Workload) -> None:
    """Data, a briefly trained checkpoint (gradients at initialization are atypical), and the
    exact scores: everything the systems share."""
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(w.seed)
    ids = text_passages(w.seq_len, w.n_train + w.n_query + w.warmup_steps * w.batch, w.seed)
    train, query = ids[:w.n_train], ids[w.n_train:w.n_train + w.n_query]
    warm = ids[w.n_train + w.n_query:].to(w.device)
    model = build_model(w).to(w.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(w.warmup_steps):
        batch = warm[i * w.batch:(i + 1) * w.batch]
        opt.zero_grad(set_to_none=True)
        example_losses(model(batch), batch).mean().backward()
        opt.step()
    w.save(workdir / "workload.json")
    torch.save({"train": train, "query": query}, workdir / "data.pt")
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, workdir / "model.pt")
    mods = dict(model.named_modules())
    (workdir / "scored.json").write_text(json.dumps({n: list(mods[n].weight.shape) for n in linear_names(model)}))
    model.eval()
    g_train, g_query = exact_gradients(model, train.to(w.device)), exact_gradients(model, query.to(w.device))
    np.save(workdir / "exact.npy", (g_query @ g_train.T).cpu().numpy())
    np.save(workdir / "exact_influence.npy", exact_influence(model, g_train, g_query).cpu().numpy())
    if str(w.device).startswith("cuda"):
        del g_train, g_query            # the workers share the GPU with this process: give back the
        torch.cuda.empty_cache()        # exact gradients' tens of GB its allocator would keep


def exact_gradients(model: nn.Module, ids: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """[N, D] exact per-example gradients of the scored weights (torch.func, no projection)."""
    names = [f"{n}.weight" for n in linear_names(model)]
    params = {n: p.detach() for n, p in model.named_parameters()}
    scored = {n: params[n] for n in names}
    rest = {n: p for n, p in params.items() if n not in scored}

    def loss(weights, x):
        x = x.unsqueeze(0)
        logits = torch.func.functional_call(model, {**rest, **weights}, (x,))
        return example_losses(logits, x).sum()

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))
    rows = []
    for lo in range(0, len(ids), chunk):
        g = per_example(scored, ids[lo:lo + chunk])
        rows.append(torch.cat([g[n].reshape(len(ids[lo:lo + chunk]), -1) for n in names], dim=1))
    return torch.cat(rows)


RELATIVE_DAMPING = 0.1
"""Every curvature method's λ: 0.1 × the mean eigenvalue of the curvature it inverts (per layer
where the method is per layer) — the convention each peer offers natively."""


def exact_influence(model: nn.Module, g_train: torch.Tensor, g_query: torch.Tensor) -> torch.Tensor:
    """[Q, N] exact damped influence ``Σ_l q_lᵀ (F_l + λ_l I)⁻¹ g_l`` with the per-layer empirical
    Fisher ``F_l = G_lᵀ G_l / N`` of the unprojected train gradients and ``λ_l = 0.1 · tr(F_l)/D_l``.
    The D_l×D_l inverse is applied exactly through Woodbury on the N×N Gram, in float64:
    ``(F + λI)⁻¹ = (I − Gᵀ (NλI + G Gᵀ)⁻¹ G) / λ``."""
    n = g_train.shape[0]
    out = torch.zeros(g_query.shape[0], n, dtype=torch.float64, device=g_train.device)
    lo = 0
    for name in linear_names(model):
        size = dict(model.named_modules())[name].weight.numel()
        g, q = g_train[:, lo:lo + size].double(), g_query[:, lo:lo + size].double()
        lo += size
        gram = g @ g.T
        lam = RELATIVE_DAMPING * float(torch.trace(gram)) / n / size
        a = q @ g.T
        eye = torch.eye(n, dtype=torch.float64, device=g.device)
        out += (a - a @ torch.linalg.solve(n * lam * eye + gram, gram)) / lam
    return out.float()


def exact_scores(model: nn.Module, train: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """[Q, N] exact GradDot: ⟨∇L_q, ∇L_i⟩ over every scored weight."""
    return exact_gradients(model, query) @ exact_gradients(model, train).T


# ---------------------------------------------------------------------------------------------------
# measuring helpers


def spearman_rows(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of the Spearman rank correlation of ``a[q]`` with ``b[q]``."""
    def ranks(x):
        r = np.empty_like(x, dtype=np.float64)
        r[np.argsort(x, kind="stable")] = np.arange(len(x))
        return r
    vals = []
    for x, y in zip(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)):
        rx, ry = ranks(x), ranks(y)
        rx -= rx.mean()
        ry -= ry.mean()
        vals.append(float((rx * ry).sum() / math.sqrt((rx * rx).sum() * (ry * ry).sum())))
    return float(np.mean(vals))


def peak_rss_mb() -> float:
    """High-water resident memory of this process (``VmHWM``; unlike ``ru_maxrss`` it is not
    inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def warm_up(model: nn.Module, ids: torch.Tensor) -> None:
    """One untimed forward+backward: torch's own one-time kernel setup is nobody's cost."""
    example_losses(model(ids), ids).sum().backward()
    model.zero_grad(set_to_none=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


class Clock:
    """Wall seconds of a ``with`` block (on a GPU: from and to a synchronized device, so kernels
    queued inside the block are counted in it)."""

    def __enter__(self) -> "Clock":
        _sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync()
        self.seconds = time.perf_counter() - self.t0


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def peak_cuda_mb() -> float | None:
    """Peak CUDA memory allocated by this process (None without CUDA in use)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2 ** 20


def threads() -> None:
    """Same intra-op thread count in every process (the machine's cores, or OMP_NUM_THREADS)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
