"""The tda: section is strict: every bad key or value names its path and how to fix it."""

from __future__ import annotations

import pytest

from olmo_tda.config import ConfigError, ProjectionType, StoreDType, TDAConfig, apply_overrides


def test_defaults_and_round_trip():
    cfg = TDAConfig.from_dict({"enabled": True, "capture": {"proj_dim": [32, 16], "proj_type": "rademacher"},
                               "store": {"dtype": "bfloat16"}})
    assert cfg.enabled and cfg.capture.proj_dims == (32, 16)
    assert cfg.capture.proj_type is ProjectionType.RADEMACHER and cfg.store.dtype is StoreDType.BFLOAT16
    assert TDAConfig.from_dict(cfg.to_dict()) == cfg
    assert TDAConfig.from_dict(None) == TDAConfig()
    assert TDAConfig().capture.proj_dims == (64, 64) and not TDAConfig().enabled


@pytest.mark.parametrize("data, match", [
    ({"capture": {"proj_dimm": 3}}, r"tda\.capture\.proj_dimm: unknown key; did you mean 'proj_dim'\?"),
    ({"captur": {}}, r"tda\.captur: unknown key; did you mean 'capture'\?"),
    ({"store": {"zzz": 1}}, r"tda\.store\.zzz: unknown key; valid keys: path, dtype"),
    ({"capture": {"proj_dim": "big"}}, r"tda\.capture\.proj_dim: 'big' matches none of"),
    ({"capture": {"proj_dim": [1, 2, 3]}}, r"tda\.capture\.proj_dim: .*expected 2 items, got 3"),
    ({"capture": {"proj_dim": -1}}, r"tda\.capture\.proj_dim: must be >= 0"),
    ({"capture": {"proj_dim": [0, 8]}}, r"tda\.capture\.proj_dim: either both sides"),
    ({"capture": {"proj_type": "gausian"}}, r"tda\.capture\.proj_type: .*did you mean 'gaussian'"),
    ({"capture": {"seed": 1.5}}, r"tda\.capture\.seed: expected an integer, got float"),
    ({"capture": {"modules": "*"}}, r"tda\.capture\.modules: expected a list"),
    ({"capture": {"modules": [1]}}, r"tda\.capture\.modules\[0\]: expected a string"),
    ({"enabled": "yes"}, r"tda\.enabled: expected true/false"),
    ({"store": {"flush_every": 0}}, r"tda\.store\.flush_every: must be >= 1"),
    ({"store": {"flush_mb": 0}}, r"tda\.store\.flush_mb: must be a positive number of MB, got 0"),
    ({"store": {"compression": "zstd"}}, r"tda\.store\.compression"),
    ({"store": []}, r"tda\.store: expected a mapping"),
    ({"batch": {"reducton": "sum"}}, r"tda\.batch\.reducton: unknown key; did you mean 'reduction'\?"),
    ({"batch": {"reduction": "mean"}}, r"tda\.batch\.reduction: 'mean' is not one of \['token_mean', 'example_mean', 'sum'\]"),
    ({"batch": {"ids_key": ""}}, r"tda\.batch\.ids_key: must be a non-empty key name"),
])
def test_bad_input_names_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        TDAConfig.from_dict(data)


def test_yaml_section_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model: {d_model: 64}\ntda:\n  enabled: true\n  capture:\n    proj_dim: 16\n")
    cfg = TDAConfig.from_yaml(f, overrides=["--tda.capture.proj_dim=32", "store.dtype=float16",
                                            "capture.modules=['*att_proj']"])
    assert cfg.capture.proj_dim == 32 and cfg.store.dtype is StoreDType.FLOAT16
    assert cfg.capture.modules == ["*att_proj"]
    with pytest.raises(ConfigError, match="tda.capture.seeed: unknown key; did you mean 'seed'"):
        TDAConfig.from_yaml(f, overrides=["capture.seeed=3"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["capture.seed"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("tda: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TDAConfig.from_yaml(bad)


@pytest.mark.parametrize("kwargs, match", [
    ({"proj_dim": "64"}, r"capture\.proj_dim: '64' matches none of"),
    ({"proj_dim": (64,)}, r"expected 2 items, got 1"),
    ({"proj_dim": True}, r"got bool True"),
    ({"modules": "blocks.*"}, r"capture\.modules: expected a list"),
    # an override built in Python: a str of patterns would be read a character at a time ('*': every layer)
    ({"overrides": [{"modules": "*ff_out", "rank": 3}]}, r"capture\.overrides\[0\]\.modules: expected a list"),
    ({"overrides": [{"modules": ["0"], "rank": 2.5}]}, r"capture\.overrides\[0\]\.rank: .*got float 2\.5"),
    ({"overrides": [{"modules": ["0"], "proj_dim": (16.0, 8)}]}, r"capture\.overrides\[0\]\.proj_dim: .* float 16\.0"),
])
def test_configs_built_in_python_are_checked_too(kwargs, match):
    from olmo_tda import CaptureConfig, GradientCapture
    from olmo_tda.config import LayerOverride
    import torch
    if "overrides" in kwargs:
        kwargs = {**kwargs, "overrides": [LayerOverride(**o) for o in kwargs["overrides"]]}
    with pytest.raises(ConfigError, match=match):
        GradientCapture(torch.nn.Linear(2, 2), CaptureConfig(**kwargs))


def test_a_non_mapping_tda_section_is_an_error(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("tda: false\n")
    with pytest.raises(ConfigError, match="tda: expected a mapping, got bool"):
        TDAConfig.from_yaml(f)
    f.write_text("model: {}\n")
    assert TDAConfig.from_yaml(f) == TDAConfig()


def test_an_override_into_a_value_names_its_full_key():
    with pytest.raises(ConfigError, match=r"tda\.capture\.modules is not a section"):
        apply_overrides({"capture": {"modules": ["a"]}}, ["capture.modules.0=x"])
