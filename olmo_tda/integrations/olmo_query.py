"""Ask an OLMo run which training passages made it produce a text (``olmo-tda attribute RUN``).

A run directory written by ``olmo-tda train`` holds everything needed: OLMo's ``config.yaml`` (model,
tokenizer, data paths), ``tda.yaml`` (the capture config, hence the projectors; with ``proj_type:
eigen`` also ``tda/basis.safetensors`` or the file ``capture.basis`` names), the latest
unsharded checkpoint (weights, read with ``weights_only=True``), the gradient store, and the
memmap training data to decode passages by their global index.

Example::

    from olmo_tda.integrations.olmo_query import OLMoRun
    from olmo_tda.methods.queries import Query
    run = OLMoRun("demo_out/run")
    answers = run.attribute([Query("The for statement is used to", " iterate")], top_k=5, group_by="document")
    print(answers[0]["results"][0])        # {"index": ..., "name": ..., "score": ..., "source": ..., "text": ...}
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import yaml

from ..capture import GradientCapture, activation_grads_only
from ..data import Corpus
from ..config import ConfigError, ProjectionType, TDAConfig, apply_overrides
from ..demo.corpus import ByteTokenizer
from ..demo.data import BYTE_TOKENIZER_ID
from ..methods import attribute
from ..methods.base import projector_difference
from ..methods.grouping import ByDocument, ByExample, BySource, GroupBy, GroupScores
from ..methods.queries import Query, query_gradients
from ..store import GradientStore
from .olmo import TDA_YAML, basis_path

RUN_JSON = "run.json"
"""What a DeepSpeed run of ``examples/deepspeed_pretrain.py`` writes beside its outputs, for queries:
``model`` (OLMo ``ModelConfig`` fields), ``data_paths``, ``seq_len``, ``tokenizer``, ``tda`` (the
config) and ``weights`` (the final full weights' file name)."""
WEIGHTS_FILE = "model.safetensors"
"""The final full weights of such a run."""

__all__ = ["OLMoRun", "DeepSpeedRun", "open_run", "run_outputs", "saved_tda_config", "RUN_JSON", "WEIGHTS_FILE"]

log = logging.getLogger(__name__)


class OLMoRun:
    """A finished (or checkpointed) ``olmo-tda train`` run, opened for queries."""

    query_projector_specs: dict[str, Any] | None = None
    """The projector specs of the last :meth:`query_gradients` (to name what differs from the store's)."""

    def __init__(self, run_dir: str | Path, checkpoint: str | Path | None = None, *, skip_damaged: bool = False):
        from olmo.config import TrainConfig
        from olmo.model import OLMo

        self.dir = _demo_run(Path(run_dir))
        for needed in ("config.yaml", TDA_YAML):
            if not (self.dir / needed).is_file():
                raise FileNotFoundError(f"{self.dir} is not an olmo-tda run directory (no {needed})")
        try:
            self.cfg = TrainConfig.load(self.dir / "config.yaml", validate_paths=False)
        except Exception as e:  # noqa: BLE001 - YAML, OmegaConf and OLMo's own errors: all a damaged file
            raise ConfigError(f"{self.dir / 'config.yaml'}: not a readable OLMo config "
                              f"({type(e).__name__}: {_one_line(e)})") from None
        self.tda = saved_tda_config(self.dir / TDA_YAML)
        if self.tda.capture.proj_type is ProjectionType.EIGEN:     # the frozen eigenbasis the run trained with
            self.tda.capture.basis = str(basis_path(self.tda.capture, self.dir))
        self.store = GradientStore.open(Path(self.tda.store.path or self.dir / "tda" / "store"),
                                        skip_damaged=skip_damaged)
        ckpt = Path(checkpoint) if checkpoint else self._latest_checkpoint()
        self.cfg.model.init_device = "cpu"
        self.model = OLMo(self.cfg.model)
        self.model.load_state_dict(torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True))
        self.model.eval()
        self.checkpoint = ckpt
        self.tokenizer = self._tokenizer()
        self._dataset = None
        self._corpus: Corpus | None = None

    def _latest_checkpoint(self) -> Path:
        found = sorted((p for p in self.dir.glob("step*-unsharded") if _UNSHARDED.match(p.name)),
                       key=lambda p: int(_UNSHARDED.match(p.name)[1]))
        if not found:
            raise FileNotFoundError(f"{self.dir} has no unsharded checkpoint (stepN-unsharded/model.pt) to "
                                    "compute query gradients with; set save_interval_unsharded in the run")
        return found[-1]

    def _tokenizer(self):
        if self.cfg.tokenizer.identifier == BYTE_TOKENIZER_ID:
            return ByteTokenizer()
        from olmo.tokenizer import Tokenizer
        return Tokenizer.from_train_config(self.cfg)

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False) if not isinstance(
            self.tokenizer, ByteTokenizer) else self.tokenizer.encode(text)
        return ids

    def passage(self, index: int) -> str:
        """Decoded text of training instance ``index`` (OLMo's global instance id)."""
        if self._dataset is None:
            from olmo.data import build_memmap_dataset
            self._dataset = build_memmap_dataset(self.cfg, self.cfg.data)
        return self.tokenizer.decode(self._dataset[int(index)]["input_ids"].tolist())

    @property
    def corpus(self) -> Corpus:
        """The run's training data as instances, documents and sources (:class:`~olmo_tda.data.Corpus`)."""
        if self._corpus is None:
            data = self.cfg.data
            if data.paths:
                paths, labels = list(data.paths), None
            elif data.datasets:
                paths = [p for label in sorted(data.datasets) for p in data.datasets[label]]
                labels = [label for label in sorted(data.datasets) for _ in data.datasets[label]]
            else:
                raise ValueError(f"{self.dir}: the run's config names no training data (data.paths or data.datasets)")
            self._corpus = Corpus(paths, labels=labels, seq_len=self.cfg.model.max_sequence_length,
                                  eos_token_id=self.cfg.model.eos_token_id,
                                  dtype=getattr(data, "effective_memmap_dtype", np.uint16),
                                  decode=lambda ids: self.tokenizer.decode(ids))
        return self._corpus

    def query_gradients(self, queries: list[str | Query], *, per_basis: bool = True
                        ) -> tuple[dict[str, torch.Tensor], str]:
        """Projected gradients ``{layer: [Q, Ko, Ki]}`` of each query's loss (a text's summed token loss,
        a prompt → answer query's answer tokens only: :class:`~olmo_tda.methods.queries.Query`) at the
        checkpoint's weights, through projectors identical to the store's (their hash is returned).
        A store of several eigenbasis versions gets one projection per version (a ``BasisQueries``)
        unless ``per_basis=False``: then the capture config's basis, as :meth:`train_gradients` uses."""
        items = [(q if isinstance(q, Query) else Query(q)).tokens(
            self._encode, eos_token_id=self.cfg.model.eos_token_id, max_len=self.cfg.model.max_sequence_length)
            for q in queries]
        capture = GradientCapture(self.model, self.tda.capture)
        try:
            grads = query_gradients(self.model, capture, items, store=self.store if per_basis else None)
            self.query_projector_specs = capture.projector_specs     # names what differs from the store's
            return grads, capture.projector_hash
        finally:
            capture.remove()

    # -- trajectory (TracIn) -------------------------------------------------------------------

    @property
    def trajectory_path(self) -> Path:
        return Path(self.tda.trajectory.path or self.dir / "tda" / "trajectory")

    def checkpoints(self) -> list:
        """Kept trajectory checkpoints, oldest first (:class:`TrajectoryCheckpoint`)."""
        from ..training.trajectory import Trajectory

        return Trajectory.list(self.trajectory_path)

    def load_weights(self, ckpt: Any) -> None:
        """Put a trajectory checkpoint's weights into the model (queries then run at θ_ckpt)."""
        if ckpt.projector_hash is not None and ckpt.projector_hash != self.store.meta.get("projector_hash"):
            raise ValueError(f"trajectory checkpoint {ckpt.path} was kept with projectors {ckpt.projector_hash}, "
                             f"the store has {self.store.meta.get('projector_hash')}")
        weights = ckpt.load()
        try:
            self.model.load_state_dict(weights)
        except RuntimeError as e:                # another model's weights: size mismatch, missing keys
            raise ValueError(f"trajectory checkpoint {ckpt.path} does not fit this run's model ({e})") from None
        self.model.eval()

    def train_gradients(self, ids: np.ndarray, *, batch_size: int = 64, progress: bool = False
                        ) -> Iterator[tuple[np.ndarray, dict[str, torch.Tensor]]]:
        """Projected gradients of training instances ``ids`` (each instance's summed next-token CE,
        as training computed it) at the model's current weights, ``batch_size`` at a time."""
        from tqdm.auto import tqdm

        if self._dataset is None:
            from olmo.data import build_memmap_dataset
            self._dataset = build_memmap_dataset(self.cfg, self.cfg.data)
        capture = GradientCapture(self.model, self.tda.capture)
        try:
            with activation_grads_only(self.model):
                for start in tqdm(range(0, len(ids), batch_size), disable=not progress, unit="batch", leave=False):
                    chunk = np.asarray(ids[start:start + batch_size], dtype=np.int64)
                    tokens = torch.stack([torch.as_tensor(self._dataset[int(i)]["input_ids"], dtype=torch.long)
                                          for i in chunk])
                    with capture.record(chunk) as rec:
                        logits = self.model(tokens).logits
                        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                          tokens[:, 1:].flatten(), reduction="sum").backward()
                    self.model.zero_grad(set_to_none=True)
                    yield chunk, rec.dense()
        finally:
            capture.remove()

    def num_instances(self) -> int:
        if self._dataset is None:
            from olmo.data import build_memmap_dataset
            self._dataset = build_memmap_dataset(self.cfg, self.cfg.data)
        return len(self._dataset)

    def tracin(self, texts: list[str | Query], *, inrun: bool = False, ids: np.ndarray | None = None,
               checkpoints: list | None = None, batch_size: int = 64, progress: bool = False):
        """TracIn scores ``([Q, N], example ids [N])``: TracIn-CP over the kept checkpoints (training
        examples ``ids``, default all instances), or in-run TracIn over the store's rows."""
        from ..methods.tracin import tracin_cp, tracin_inrun

        ckpts = checkpoints if checkpoints is not None else self.checkpoints()
        if not ckpts:
            raise ValueError(f"no trajectory checkpoints in {self.trajectory_path}")
        original = {k: v.clone() for k, v in self.model.state_dict().items()}
        store_hash = self.store.meta.get("projector_hash")

        def queries_at(ckpt):
            self.load_weights(ckpt)
            # in-run rows carry their versions; TracIn-CP recomputes the training side with one basis
            grads, projector_hash = self.query_gradients(texts, per_basis=inrun)
            if projector_hash != store_hash:
                raise ValueError(f"query projectors {projector_hash} differ from the store's {store_hash}: "
                                 + projector_difference(self.query_projector_specs, self.store.meta))
            return grads

        try:
            if inrun:
                by_step = {c.step: c for c in ckpts}
                return tracin_inrun(self.store, lambda step: queries_at(by_step[step]), sorted(by_step))
            ids = np.arange(self.num_instances()) if ids is None else np.asarray(ids, dtype=np.int64)
            fingerprint = {"texts": [_fingerprint(q) for q in texts], "ids": hashlib.sha256(ids.tobytes()).hexdigest(),
                           "projector_hash": store_hash, "run": str(self.dir.resolve())}
            return tracin_cp(ckpts, queries_at,
                             lambda ckpt: self.train_gradients(ids, batch_size=batch_size, progress=progress),
                             layers=list(self.store.layers), work_dir=self.dir / "tda" / "tracin",
                             fingerprint=fingerprint,
                             progress=(lambda msg: log.info("tracin: %s done", msg)))
        finally:
            self.model.load_state_dict(original)

    def attribute(self, queries: list[str | Query], *, method: str = "influence", top_k: int = 10,
                  group_by: str = "example", progress: bool = False, ids: Any = None,
                  **method_options: Any) -> list[dict[str, Any]]:
        """``[{"query", "results": [...]}, ...]``, best first, per query (a text, or a prompt → answer
        :class:`~olmo_tda.methods.queries.Query`). ``group_by`` (see :mod:`olmo_tda.methods.grouping`):

        - ``example`` (default): ``{"index", "score", "source", "text"}``, each training instance once,
          its score summed over the steps it was trained at;
        - ``document``: ``{"index", "name", "score", "source", "text"}``, a document of the data files;
        - ``source``: ``{"index", "source", "score", "instances"}``, a data file or ``data.datasets`` label;
        - ``row``: ``{"index", "step", "score", "source", "text"}``, one (example, step) row as stored
          (not for TracIn, which scores examples).

        A query longer than the model's ``max_sequence_length`` is cut, and its answer says so
        (``tokens``, ``scored_tokens``)."""
        queries = [q if isinstance(q, Query) else Query(q) for q in queries]
        texts = [q.text for q in queries]
        try:
            kind = GroupBy(group_by)
        except ValueError:
            raise ValueError(f"group_by must be one of {[g.value for g in GroupBy]}, got {group_by!r}") from None
        grouping = (None if kind is GroupBy.ROW else ByExample() if kind is GroupBy.EXAMPLE
                    else ByDocument(self.corpus) if kind is GroupBy.DOCUMENT else BySource(self.corpus))
        if method in ("tracin", "tracin-inrun"):
            from ..methods.tracin import top_examples

            if kind is GroupBy.ROW:
                raise ValueError(f"{method} scores examples (summed over checkpoints or steps), not rows: use "
                                 "group_by example, document or source")
            if ids is not None and method != "tracin":
                raise ValueError("ids= selects the training examples of TracIn-CP (method='tracin')")
            if ids is not None and (min(ids) < 0 or max(ids) >= self.num_instances()):
                raise ValueError(f"ids must be training instance indices in [0, {self.num_instances()})")
            scores, example_ids = self.tracin(queries, inrun=method == "tracin-inrun", ids=ids, progress=progress)
            result = top_examples(method, scores, example_ids, top_k, list(self.store.layers))
            if kind is not GroupBy.EXAMPLE:
                groups = GroupScores(grouping, scores.shape[0])
                groups.add(scores, example_ids)
                result.scores, result.ids = groups.top(top_k)
                result.steps, result.group_by = np.full_like(result.ids, -1), kind.value
        else:
            grads, projector_hash = self.query_gradients(queries)
            result = attribute(self.store, grads, method=method, top_k=top_k, projector_hash=projector_hash,
                               projector_specs=self.query_projector_specs, group_by=grouping or "row",
                               **method_options)
        self.last_info = {**result.info, "group_by": kind.value}   # what decided this answer (λ, route, ...)
        if self.store.skipped:
            self.last_info["skipped_rows"] = sum(v["rows"] for v in self.store.skipped.values())
            self.last_info["skipped_shards"] = sorted(self.store.skipped)
        out = []
        for query, text, rows in zip(queries, texts, result.as_dicts()):
            answer = {"query": text, "results": [self._describe(kind, row) for row in rows]}
            if query.completion is not None:
                answer.update(prompt=query.prompt, completion=query.completion)
            tokens = len(self._encode(text))
            if query.completion is None and tokens > self.cfg.model.max_sequence_length:
                answer.update(tokens=tokens, scored_tokens=self.cfg.model.max_sequence_length)
            out.append(answer)
        return out

    def _describe(self, kind: GroupBy, row: dict[str, Any]) -> dict[str, Any]:
        """An answer's entry with what a reader needs: text and source (a document's name)."""
        index = row["index"]
        if kind is GroupBy.SOURCE:
            return {"index": index, "source": self.corpus.sources[index], "score": row["score"],
                    "instances": int(self.corpus.source_instances()[index])}
        if kind is GroupBy.DOCUMENT:
            return {"index": index, "name": self.corpus.document_name(index), "score": row["score"],
                    "source": self.corpus.document_source(index), "text": self.corpus.document_text(index)}
        entry = {"index": index, **({"step": row["step"]} if kind is GroupBy.ROW else {}), "score": row["score"],
                 "source": self.corpus.sources[int(self.corpus.source_of(np.array([index]))[0])],
                 "text": self.passage(index)}
        return entry


class DeepSpeedRun(OLMoRun):
    """A run of the DeepSpeed example (``examples/deepspeed_pretrain.py``), opened for the
    same queries: its ``run.json`` (model, data, tokenizer, tda), final ``model.safetensors`` and
    store. The model is wrapped like ``CausalLM`` (``olmo.`` prefix) so layer names, hence
    projectors, match the store's."""

    @property
    def trajectory_path(self) -> Path:
        return self._trajectory

    def __init__(self, run_dir: str | Path, *, skip_damaged: bool = False):
        from olmo.config import DataConfig, ModelConfig, TokenizerConfig, TrainConfig
        from olmo.model import OLMo
        from safetensors.torch import load_file

        self.dir = Path(run_dir)
        meta_file = self.dir / RUN_JSON
        if not meta_file.is_file():
            raise FileNotFoundError(f"{self.dir} is not a DeepSpeed example run directory (no {RUN_JSON})")
        meta = _read_run_json(meta_file)
        self.tda = saved_tda_config(meta_file, meta["tda"])
        self.store = GradientStore.open(Path(self.tda.store.path or self.dir / "tda" / "store"),
                                        skip_damaged=skip_damaged)
        self._trajectory = Path(self.tda.trajectory.path or _deepspeed_trajectory(self.store.path))
        model_cfg = ModelConfig(**{**meta["model"], "init_device": "cpu"})
        if model_cfg.max_sequence_length != meta["seq_len"]:
            raise ValueError(f"{self.dir}: data seq_len {meta['seq_len']} != model.max_sequence_length "
                             f"{model_cfg.max_sequence_length}; passages cannot be decoded by index")
        if not meta.get("tokenizer"):
            raise ValueError(f"{self.dir}: the run has no tokenizer (set `tokenizer:` in its YAML) to encode queries")
        self.cfg = TrainConfig(model=model_cfg, data=DataConfig(paths=meta["data_paths"], memmap_dtype="uint16"),
                               tokenizer=TokenizerConfig(identifier=meta["tokenizer"]))
        weights = self.dir / meta["weights"]
        if not weights.is_file():
            raise FileNotFoundError(f"{weights}: the run has not finished (no final weights to query with)")
        self.model = _Prefixed(OLMo(model_cfg))
        self.model.load_state_dict(load_file(str(weights)))
        self.model.eval()
        self.checkpoint = weights
        self.tokenizer = self._tokenizer()
        self._dataset = None
        self._corpus: Corpus | None = None


def run_outputs(path: str | Path) -> tuple[Path, Path] | None:
    """The gradient store and trajectory folder a run directory's saved config names (an OLMo run's
    ``tda.yaml``, the DeepSpeed example's ``run.json``; also under ``path/run``, the demo's output),
    or None where ``path`` is not a run directory."""
    for run in (Path(path), Path(path) / "run"):
        if (run / TDA_YAML).is_file():
            tda = saved_tda_config(run / TDA_YAML)
            return (Path(tda.store.path or run / "tda" / "store"),
                    Path(tda.trajectory.path or run / "tda" / "trajectory"))
        if (run / RUN_JSON).is_file():
            tda = saved_tda_config(run / RUN_JSON, _read_run_json(run / RUN_JSON)["tda"])
            store = Path(tda.store.path or run / "tda" / "store")
            return store, Path(tda.trajectory.path or _deepspeed_trajectory(store))
    return None


def _deepspeed_trajectory(store: Path) -> Path:
    from .deepspeed import default_trajectory_path     # the DeepSpeed integration's own default

    return default_trajectory_path(store)


def _read_run_json(meta_file: Path) -> dict[str, Any]:
    import json

    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{meta_file}: not valid JSON ({e})") from None
    missing = [k for k in ("tda", "model", "seq_len", "data_paths", "weights")
               if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ConfigError(f"{meta_file}: damaged (missing {', '.join(missing)}); the DeepSpeed example writes it "
                          "when a run starts")
    return meta


def saved_tda_config(file: Path, data: Any = None) -> TDAConfig:
    """The ``tda:`` section a run saved (``file``: its ``tda.yaml``, or the already parsed ``data`` of
    ``file``), for queries: its selection section is not checked (queries never read the selection
    target, which may be gone since). Any damage is a :class:`ConfigError` naming ``file``."""
    try:
        if data is None:
            raw = yaml.safe_load(file.read_text())
            if not isinstance(raw, dict) or not isinstance(raw.get("tda"), dict):
                raise ConfigError(f"expected a mapping with a tda: section, got {type(raw).__name__}")
            data = raw["tda"]
        if not isinstance(data, dict):
            raise ConfigError(f"tda: expected a mapping, got {type(data).__name__}")
        return TDAConfig.from_dict(apply_overrides(data, ["selection.enabled=false"]))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid YAML ({_one_line(e)})") from None
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


_UNSHARDED = re.compile(r"^step(\d+)-unsharded$")


def _fingerprint(query: str | Query) -> Any:
    """A query as TracIn-CP's resume key holds it: a text as before, a prompt → answer pair as a list."""
    if isinstance(query, str) or query.completion is None:
        return query if isinstance(query, str) else query.prompt
    return [query.prompt, query.completion]


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:500]


class _Prefixed(torch.nn.Module):
    """``olmo.``-prefixed OLMo, named like the DeepSpeed example's ``CausalLM`` but taking token ids."""

    def __init__(self, olmo: torch.nn.Module):
        super().__init__()
        self.olmo = olmo

    def forward(self, input_ids: torch.Tensor):
        return self.olmo(input_ids)


def open_run(run_dir: str | Path, *, skip_damaged: bool = False) -> OLMoRun:
    """An OLMo run (``olmo-tda train``) or a DeepSpeed example run, whichever ``run_dir`` holds;
    ``skip_damaged``: answers leave out store shards whose checksums fail (see ``GradientStore.open``)."""
    run_dir = _demo_run(Path(run_dir))
    return (DeepSpeedRun(run_dir, skip_damaged=skip_damaged) if (run_dir / RUN_JSON).is_file()
            else OLMoRun(run_dir, skip_damaged=skip_damaged))


def _demo_run(path: Path) -> Path:
    """The run in ``olmo-tda demo``'s output folder (``<out>/run``), as the CLI takes it; else ``path``."""
    if not (path / "config.yaml").exists() and (path / "run" / "config.yaml").exists():
        return path / "run"
    return path
