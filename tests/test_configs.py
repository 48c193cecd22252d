"""The shipped configs: every YAML in configs/ loads through our OLMo loader (without the data files
existing), the OLMo-1B config says what it should, every `tda:` key is explained on its line, and
OLMo-1B's architecture gives the capture exactly the Linears the config's estimate counts."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from olmo_tda.capture import GradientCapture
from olmo_tda.config import StoreDType, TDAConfig
from olmo_tda.integrations.olmo import load_configs

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
DEEPSPEED_CONFIGS = [p for p in CONFIGS if p.name.startswith("deepspeed")]   # run YAMLs of the DeepSpeed example
OLMO_CONFIGS = [p for p in CONFIGS if p not in DEEPSPEED_CONFIGS]
OLMO_1B = CONFIGS[0].parent / "olmo_1b.yaml"
BLOCK_LINEARS = ("att_proj", "attn_out", "ff_proj", "ff_out")


def _steps(cfg) -> int:
    """OLMo's meaning of max_duration in steps (an int is steps; "…T" tokens; "…ep" is not used here)."""
    if isinstance(cfg.max_duration, int):
        return cfg.max_duration
    assert cfg.max_duration.endswith("T"), cfg.max_duration
    return int(float(cfg.max_duration[:-1])) // (cfg.global_train_batch_size * cfg.model.max_sequence_length)


def _tda_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the indented lines of the top-level `tda:` section, comments skipped."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"tda:\s*(#.*)?$", line)), None)
    assert start is not None, f"{path.name}: no top-level tda: section"
    out = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():                   # the next top-level key ends the section
            break
        out.append((i + 1, line))
    return out


def _leaf_keys(tda: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tda.items():
        if isinstance(value, dict):
            keys |= _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def test_there_are_configs():
    assert OLMO_1B in CONFIGS and len(OLMO_CONFIGS) >= 2 and DEEPSPEED_CONFIGS


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=lambda p: p.name)
def test_deepspeed_config_loads_and_its_tda_section_parses(path):
    from olmo.config import ModelConfig

    from conftest import deepspeed_example

    load_config = deepspeed_example().load_config

    cfg = load_config(path, ["--steps=3"])
    assert cfg["steps"] == 3 and cfg["deepspeed"]["zero_optimization"]["stage"] in (0, 1, 2, 3)
    tda = TDAConfig.from_dict(cfg["tda"])
    assert tda.enabled and tda.batch.ids_key == "index"
    ModelConfig(**cfg["model"])                     # every model key is an OLMo ModelConfig field


@pytest.mark.parametrize("path", OLMO_CONFIGS, ids=lambda p: p.name)
def test_config_loads_without_its_data(path):
    cfg, tda = load_configs(path)          # plain data paths: nothing is globbed or opened
    assert isinstance(tda, TDAConfig)
    assert cfg.stop_at == _steps(cfg), "stop_at: OLMo otherwise runs 10 steps past max_duration"
    assert cfg.global_train_batch_size % cfg.device_train_microbatch_size == 0


def _documented_tda_keys(path: Path) -> set[str]:
    """Dotted leaf keys of the `tda:` section, asserting each has a comment on its line."""
    documented = set()
    stack: list[tuple[int, str]] = []          # (indent, key) of the mappings we are inside
    for lineno, line in _tda_lines(path):
        m = re.match(r"(\s+)([A-Za-z_]\w*):(.*)$", line)
        assert m, f"{path.name}:{lineno}: expected a `key: value` line under tda:, got {line!r}"
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value = re.sub(r"\"[^\"]*\"|'[^']*'", "", rest)   # a '#' inside a quoted string is no comment
        if not value.split("#")[0].strip():               # a mapping header (capture:, store:)
            stack.append((indent, key))
            continue
        assert "#" in value, f"{path.name}:{lineno}: tda key {key!r} has no comment explaining it"
        dotted = ".".join([k for _, k in stack] + [key])
        assert dotted not in documented, f"{path.name}:{lineno}: tda key {dotted!r} appears twice (YAML keeps the last)"
        documented.add(dotted)
    return documented


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_tda_key_is_commented(path):
    """Every key of the `tda:` section is shown, each with a comment; ``batch.*`` only where a loop
    without OLMo's trainer reads it (the DeepSpeed configs)."""
    documented = _documented_tda_keys(path)
    known = _leaf_keys(TDAConfig(enabled=True).to_dict())
    unknown = documented - known
    assert documented and not unknown, (path.name, unknown)   # loading rejects unknown keys too
    missing = {k for k in known - documented if path in DEEPSPEED_CONFIGS or not k.startswith("batch.")}
    assert not missing, (path.name, sorted(missing))


def test_configs_show_the_same_tda_keys():
    """A key explained in one shipped config is explained in all of them — except ``batch.*``, which
    only loops without OLMo's trainer read (the DeepSpeed configs explain it)."""
    keys = {path.name: {k for k in _documented_tda_keys(path) if not k.startswith("batch.")} for path in CONFIGS}
    union = set().union(*keys.values())
    assert all(k == union for k in keys.values()), {name: sorted(union - k) for name, k in keys.items()}
    for path in DEEPSPEED_CONFIGS:
        assert {k for k in _documented_tda_keys(path) if k.startswith("batch.")} >= {"batch.ids_key", "batch.reduction"}


def test_olmo_1b_values():
    cfg, tda = load_configs(OLMO_1B)
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_heads, m.mlp_ratio) == (2048, 16, 16, 8)
    assert m.activation_type == "swiglu" and m.rope and m.weight_tying and not m.include_bias
    assert (m.vocab_size, m.embedding_size, m.max_sequence_length) == (50280, 50304, 2048)
    assert cfg.distributed_strategy == "fsdp" and cfg.fsdp.wrapping_strategy == "by_block"
    assert cfg.fsdp.precision == "mixed" and cfg.fsdp.sharding_strategy.name == "FULL_SHARD"
    assert cfg.precision == "amp_bf16"
    assert cfg.optimizer.learning_rate == 4e-4 and cfg.optimizer.weight_decay == 0.1
    assert tuple(cfg.optimizer.betas) == (0.9, 0.95)
    assert (cfg.scheduler.name, cfg.scheduler.t_warmup, cfg.scheduler.alpha_f) == ("cosine_with_warmup", 2000, 0.1)
    assert (cfg.global_train_batch_size, cfg.device_train_microbatch_size) == (2048, 8)
    assert cfg.stop_at == _steps(cfg) == 739_328
    assert (cfg.save_interval, cfg.save_interval_unsharded) == (1000, 10000)
    assert cfg.wandb is not None and cfg.wandb.project
    assert cfg.tokenizer.identifier == "tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json"
    assert tda.enabled and tda.capture.proj_dims == (16, 16) and tda.store.dtype is StoreDType.BFLOAT16
    assert tda.capture.proj_type.value == "eigen" and tda.capture.basis_every == 1000
    assert tda.store.flush_every == 100 and tda.capture.exclude == []


def test_olmo_1b_overrides_reach_both_configs():
    assert load_configs(OLMO_1B)[0].save_folder == "runs/olmo-1b"
    cfg, tda = load_configs(OLMO_1B, ["--max_duration=20", "--stop_at=20", "--tda.capture.proj_dim=16",
                                      "--data.paths=[a.npy,b.npy]", "--run_name=trial"])
    assert (cfg.max_duration, cfg.stop_at, cfg.data.paths) == (20, 20, ["a.npy", "b.npy"])
    assert cfg.save_folder == "runs/trial" and cfg.wandb.name == "trial"   # launch/slurm_olmo.sbatch's RUN_NAME
    assert tda.capture.proj_dims == (16, 16)


def test_olmo_1b_architecture_captures_four_linears_per_block(tmp_path):
    """OLMo-1B's model config, shrunk (a 1B model is too heavy for a unit test): the capture selects
    exactly att_proj, attn_out, ff_proj, ff_out of every block and no head (weight tying: the logits
    use F.linear on wte.weight), and stores k x k per layer — the count the config's estimate uses:
    16 x 16 in the eigenbasis that follows the run, and the random projections' shapes alike."""
    from olmo.model import OLMo

    from olmo_tda.capture.eigenbasis import estimate_eigenbasis

    cfg, tda = load_configs(OLMO_1B)
    following = tda.capture
    tda.capture = dataclasses.replace(tda.capture, proj_type="orthogonal", proj_dim=64, basis_every=0)
    small = dataclasses.replace(cfg.model, d_model=64, n_layers=2, n_heads=4, vocab_size=128, embedding_size=128,
                                max_sequence_length=32, eos_token_id=127, pad_token_id=1, init_device="cpu",
                                flash_attention=False)
    torch.manual_seed(0)
    model = OLMo(small)
    assert not any(n.endswith("ff_out") and not n.startswith("transformer.blocks") for n, _ in model.named_modules())
    expected = {f"transformer.blocks.{i}.{name}" for i in range(small.n_layers) for name in BLOCK_LINEARS}
    with GradientCapture(model, tda.capture) as cap:
        assert set(cap.modules) == expected
        # every side is >= 64 wide here (att_proj out 192, ff_proj out 512, ff_out in 256), as in OLMo-1B
        assert set(cap.layer_shapes.values()) == {(64, 64)}
    with GradientCapture(model, dataclasses.replace(tda.capture, modules=["*"])) as cap:
        assert set(cap.modules) == expected          # "*" would add a head if there were one
    # a k wider than a side keeps that side exact (identity) instead of padding it
    with GradientCapture(model, dataclasses.replace(tda.capture, proj_dim=128)) as cap:
        shapes = {n.rsplit(".", 1)[1]: s for n, s in cap.layer_shapes.items()}
        assert shapes == {"att_proj": (128, 64), "attn_out": (64, 64), "ff_proj": (128, 64), "ff_out": (64, 128)}
    tokens = torch.randint(0, 128, (2, 32))
    basis = tmp_path / "basis.safetensors"
    following = dataclasses.replace(following, basis=str(basis))
    estimate_eigenbasis(model, [tokens], lambda m, t: m(t).logits.sum(), following).save(basis)
    with GradientCapture(model, following) as cap:
        assert set(cap.modules) == expected and set(cap.layer_shapes.values()) == {(16, 16)}
        assert cap.basis_version is not None and cap.projector_specs[next(iter(expected))]["basis"] == "versioned"
