"""``store.json``: the store's self-description, built once and checked on every append.

Written by the first writer (atomically) from the capture engine's ``meta`` plus what the store
knows (format, dtype, convention, library version). A writer reopening the store must agree on
:data:`COMPARED_KEYS`; otherwise :class:`StoreMismatchError` prints both sides of each difference.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from olmo_tda.config import ConfigError, StoreDType

from .errors import StoreCorruptError, StoreError, StoreMismatchError
from .format import FORMAT_NAME, FORMAT_VERSION, STORE_JSON

__all__ = ["GRADIENT_CONVENTION", "REPRESENTATION", "COMPARED_KEYS", "build_store_meta",
           "check_meta_compatible", "load_store_json"]

GRADIENT_CONVENTION = "sum_token_loss;loss_scale=update_share"
"""Rows are gradients of each example's summed token loss; ``loss_scale`` is the divisor between a row
and its share of the applied update, data-parallel ranks included (stores written before that was
so say ``"sum_token_loss"`` and are not appended to: their in-run TracIn weights differ by the world
size)."""
REPRESENTATION = "dense"     # "lorif" when any layer is stored as rank-c factors
# keys of store.json that must agree before a writer may append (``extra`` is free-form on purpose:
# e.g. a data fingerprint may legitimately change when selection rewrites the order)
COMPARED_KEYS = ("format_version", "gradient_convention", "representation", "dtype",
                 "capture", "layers", "projector_hash")


def _library_version() -> str:
    # imported lazily: the package __init__ may import this module
    try:
        import olmo_tda

        version = getattr(olmo_tda, "__version__", None)
        if version:
            return str(version)
    except ImportError:  # pragma: no cover - we are inside the package
        pass
    try:
        from importlib.metadata import version as dist_version

        return dist_version("olmo-tda")
    except Exception:  # noqa: BLE001 - not installed as a distribution (e.g. a source checkout)
        return "0.2.0"


def _plain(value: Any, where: str) -> Any:
    """JSON round trip: tuples become lists, str-enums strings; so caller meta compares to stored."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"store meta {where!r} is not JSON-serializable: {e}") from None


def build_store_meta(meta: dict[str, Any], dtype: StoreDType) -> dict[str, Any]:
    """The full ``store.json`` from the capture engine's ``meta`` and the store dtype.

    ``meta`` needs ``"capture"`` (dict), ``"layers"`` (list of ``{"name", "shape": [k_out, k_in],
    "projector": {...}}`` and optionally ``"rank": c`` for LoRIF factors, in a fixed order: layer
    ``i`` is ``grads/L{i:04d}``) and
    ``"projector_hash"`` (str); ``"extra"`` (dict) is optional.
    """
    if not isinstance(meta, dict):
        raise ConfigError(f"store meta must be a dict, got {type(meta).__name__}")
    missing = [k for k in ("capture", "layers", "projector_hash") if k not in meta]
    if missing:
        raise ConfigError(f"store meta lacks {missing}; the capture engine must supply "
                          "'capture', 'layers' and 'projector_hash'")
    unknown = sorted(set(meta) - {"capture", "layers", "projector_hash", "extra"})
    if unknown:
        raise ConfigError(f"store meta has unknown keys {unknown}; put free-form data under 'extra'")
    layers = []
    for i, layer in enumerate(_plain(meta["layers"], "layers")):
        if not isinstance(layer, dict) or "name" not in layer or "shape" not in layer:
            raise ConfigError(f"store meta layers[{i}] must be a dict with 'name' and 'shape', got {layer!r}")
        shape = layer["shape"]
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(d, int) and d > 0 for d in shape)):
            raise ConfigError(f"store meta layers[{i}] ({layer['name']!r}): shape must be "
                              f"[k_out, k_in] positive ints, got {shape!r}")
        rank = layer.get("rank", 0)
        if not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"store meta layers[{i}] ({layer['name']!r}): rank must be an int >= 0 "
                              f"(0 = dense), got {rank!r}")
        layers.append({"name": str(layer["name"]), "shape": shape,
                       "projector": layer.get("projector", {}),
                       **{k: v for k, v in layer.items() if k not in ("name", "shape", "projector")}})
    names = [layer["name"] for layer in layers]
    if len(set(names)) != len(names):
        raise ConfigError(f"store meta layers have duplicate names: {sorted({n for n in names if names.count(n) > 1})}")
    if not layers:
        raise ConfigError("store meta has no layers; capture at least one layer")
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "library_version": _library_version(),
        "gradient_convention": GRADIENT_CONVENTION,
        "dtype": StoreDType(dtype).value,
        "representation": "lorif" if any(layer.get("rank", 0) for layer in layers) else REPRESENTATION,
        "capture": _plain(meta["capture"], "capture"),
        "layers": layers,
        "projector_hash": str(meta["projector_hash"]),
        "extra": _plain(meta.get("extra", {}), "extra"),
        "created_unix": time.time(),
        # which store this is, wherever it is moved (never compared: every create asks for a new one,
        # and the first rank's store.json wins); a checkpoint names the store its run wrote by it
        "store_id": uuid.uuid4().hex,
    }


def _diff(stored: Any, requested: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Yield ``(path, stored, requested)`` at the deepest places where two JSON values differ."""
    if isinstance(stored, dict) and isinstance(requested, dict):
        for key in sorted(set(stored) | set(requested), key=str):
            a, b = stored.get(key, "<absent>"), requested.get(key, "<absent>")
            if a != b:
                yield from _diff(a, b, f"{path}.{key}")
    elif (isinstance(stored, list) and isinstance(requested, list) and len(stored) == len(requested)
          and any(isinstance(v, (dict, list)) for v in stored)):  # lists of scalars print whole
        for i, (a, b) in enumerate(zip(stored, requested)):
            if a != b:
                yield from _diff(a, b, f"{path}[{i}]")
    elif stored != requested:
        yield path, stored, requested


def check_meta_compatible(stored: dict[str, Any], requested: dict[str, Any], where: str) -> None:
    """Raise :class:`StoreMismatchError` listing both sides of every differing compared key."""
    lines = []
    for key in COMPARED_KEYS:
        for path, a, b in _diff(stored.get(key, "<absent>"), requested.get(key, "<absent>"), key):
            lines.append(f"  {path}:\n    stored:    {json.dumps(a)}\n    requested: {json.dumps(b)}")
    if lines:
        shown = lines[:20] + ([f"  ... and {len(lines) - 20} more differences"] if len(lines) > 20 else [])
        raise StoreMismatchError(
            f"gradient store {where} was written with different settings; refusing to append "
            f"(use a new store.path, or the settings it was created with):\n" + "\n".join(shown))


def load_store_json(root: Path) -> dict[str, Any]:
    """``store.json`` parsed and checked to be ours, of a version we read, and well-formed: every key
    the reader and writers use is present with the right type (:class:`StoreCorruptError` naming the
    file and the field otherwise)."""
    path = root / STORE_JSON
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{root} is not a gradient store (no {STORE_JSON}); check the path, or create "
                         "one with GradientStore.create") from None
    except (OSError, ValueError) as e:
        raise StoreCorruptError(f"gradient store metadata {path} is unreadable: {e}") from e
    if not isinstance(meta, dict):
        raise _damaged(path, "the file", f"must be a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME:
        raise StoreError(f"{path} is not an olmo_tda gradient store (format={meta.get('format')!r})")
    version = meta.get("format_version")
    if not _is_int(version):
        raise _damaged(path, "format_version", f"must be an int, got {version!r}")
    if version > FORMAT_VERSION:
        raise StoreError(f"{path} has format_version {version}, newer than this "
                         f"olmo_tda reads ({FORMAT_VERSION}); upgrade olmo_tda")
    _check_schema(meta, path)
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _damaged(path: Path, where: str, problem: str) -> StoreCorruptError:
    return StoreCorruptError(f"gradient store metadata {path} is damaged: {where} {problem}; restore "
                             f"{STORE_JSON} from a copy (it is written once, when the store is created, "
                             "and cannot be rebuilt from the shards)")


def _check_schema(meta: dict[str, Any], path: Path) -> None:
    """The fields :func:`build_store_meta` writes, as the reader and writers use them."""
    for key in ("gradient_convention", "representation", "projector_hash"):
        if not isinstance(meta.get(key), str):
            raise _damaged(path, key, f"must be a string, got {meta.get(key, '<absent>')!r}")
    dtypes = [d.value for d in StoreDType]
    if meta.get("dtype") not in dtypes:
        raise _damaged(path, "dtype", f"must be one of {dtypes}, got {meta.get('dtype', '<absent>')!r}")
    for key, required in (("capture", True), ("extra", False)):
        if (required or key in meta) and not isinstance(meta.get(key), dict):
            raise _damaged(path, key, f"must be a JSON object, got {meta.get(key, '<absent>')!r}")
    layers = meta.get("layers")
    if not isinstance(layers, list) or not layers:
        raise _damaged(path, "layers", f"must be a non-empty list, got {meta.get('layers', '<absent>')!r}")
    names = set()
    for i, layer in enumerate(layers):
        where = f"layers[{i}]"
        if not isinstance(layer, dict):
            raise _damaged(path, where, f"must be a JSON object, got {layer!r}")
        name = layer.get("name")
        if not isinstance(name, str) or name in names:
            raise _damaged(path, f"{where}.name", f"must be a string unique among the layers, got {name!r}")
        names.add(name)
        shape = layer.get("shape", "<absent>")
        if not (isinstance(shape, list) and len(shape) == 2 and all(_is_int(d) and d > 0 for d in shape)):
            raise _damaged(path, f"{where}.shape ({name!r})", f"must be [k_out, k_in] positive ints, got {shape!r}")
        rank = layer.get("rank", 0)
        if not (_is_int(rank) and rank >= 0):
            raise _damaged(path, f"{where}.rank ({name!r})", f"must be an int >= 0 (0 = dense), got {rank!r}")
