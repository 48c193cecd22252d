"""The configuration reference, generated from the config dataclasses' own field docs, so that
docs/CONFIG.md cannot drift from what the loader accepts.

Every field of :class:`~olmo_tda.config.TDAConfig` and its sections becomes one row: the dotted key,
the default, and the docstring written under the field in ``config.py``. Regenerate the block in
docs/CONFIG.md after changing a field (a test compares the two)::

    python -m olmo_tda.config_doc docs/CONFIG.md
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from .config import TDAConfig

__all__ = ["config_reference", "update_doc", "BEGIN", "END"]

BEGIN = "<!-- BEGIN GENERATED: config reference (python -m olmo_tda.config_doc docs/CONFIG.md) -->"
END = "<!-- END GENERATED: config reference -->"


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of the string literals written right under a dataclass's fields."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(_shown(v)).strip("`") for v in value) + "]`"
    return f"`{value}`"


def _rows(cls: type, prefix: str) -> tuple[list[str], list[tuple[type, str]]]:
    docs, rows, sections = field_docs(cls), [], []
    for field in dataclasses.fields(cls):
        value = _default(field)
        if dataclasses.is_dataclass(value):
            sections.append((type(value), f"{prefix}.{field.name}"))
            continue
        choices = ""
        if isinstance(value, enum.Enum):
            choices = " One of " + ", ".join(f"`{m.value}`" for m in type(value)) + "."
        text = (docs.get(field.name, "") + choices).replace("|", "\\|").strip()
        rows.append(f"| `{prefix}.{field.name}` | {_shown(value)} | {text} |")
    return rows, sections


def config_reference() -> str:
    """The reference as markdown: one table per section, in the order of the dataclasses' fields."""
    out: list[str] = []
    pending = [(TDAConfig, "tda")]
    while pending:
        cls, prefix = pending.pop(0)
        rows, sections = _rows(cls, prefix)
        summary = " ".join((inspect.getdoc(cls) or "").split())
        out += [f"### `{prefix}`", "", summary, "", "| key | default | meaning |", "|---|---|---|", *rows, ""]
        pending = sections + pending
    return "\n".join(out).rstrip() + "\n"


def update_doc(path: str | Path) -> bool:
    """Write the reference into ``path`` between :data:`BEGIN` and :data:`END` (appended if absent);
    returns whether the file changed."""
    path = Path(path)
    text = path.read_text()
    block = f"{BEGIN}\n\n{config_reference()}\n{END}"
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    new = pattern.sub(lambda _: block, text, count=1) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m olmo_tda.config_doc docs/CONFIG.md")
    print("updated" if update_doc(sys.argv[1]) else "up to date")
