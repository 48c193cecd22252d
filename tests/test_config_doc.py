"""docs/CONFIG.md's reference is the one generated from the config dataclasses' field docs: a field
added, removed or redocumented without regenerating it fails here, naming the command."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from olmo_tda.config import TDAConfig
from olmo_tda.config_doc import BEGIN, END, config_reference, field_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def test_config_md_holds_the_generated_reference():
    text = DOC.read_text()
    assert BEGIN in text and END in text
    held = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert held == config_reference().strip(), "docs/CONFIG.md is stale: run python -m olmo_tda.config_doc docs/CONFIG.md"


def test_every_leaf_key_has_a_row_with_its_doc():
    reference = config_reference()
    pending = [(TDAConfig, "tda")]
    while pending:
        cls, prefix = pending.pop()
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            if field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(field.default_factory()):
                pending.append((type(field.default_factory()), f"{prefix}.{field.name}"))
                continue
            assert f"| `{prefix}.{field.name}` |" in reference, field.name
            assert docs.get(field.name), f"{prefix}.{field.name} has no field docstring in olmo_tda/config.py"
