"""Where a model comes from, and loading it: the one owner of "what is this path?".

:func:`locate` tells what a path names — an HF checkpoint directory, a ``.gguf`` file, the embedded
model (``embedded:SmolLM2-135M-Instruct``), a hub name (downloaded), or a jaxrm training run (its
output directory or one of its checkpoints) — as a typed source. :func:`load` builds the model, its
tokenizer and the :class:`ScoringInfo` saved with it; a LoRA run loads its base by
``load(locate(base))`` and restores the adapters over it.

A run's output directory is read through :class:`jaxrm.run.run_files.RunFiles`; an export is written
by :mod:`jaxrm.scoring.export_files`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrm import tasks
from jaxrm.config import RunConfig
from jaxrm.data.tokenize import TokenizeOptions
from jaxrm.errors import CheckpointError, ConfigError
from jaxrm.hf import export as hf_export
from jaxrm.hf.loader import load_model, placed_abstract_model
from jaxrm.models import lora
from jaxrm.models.config import ModelConfig, from_hf_config
from jaxrm.models.decoder import Decoder
from jaxrm.run import checkpointing
from jaxrm.run.run_files import RUN_MODEL_CONFIG, RunFiles, is_run_dir, task_record
from jaxrm.tasks import asker as askers
from jaxrm.tasks.asker import Asker

log = logging.getLogger(__name__)

EMBEDDED_PREFIX = "embedded:"
# Key of an export's config.json holding its ScoringInfo (transformers ignores it).
SCORING_KEY = "jaxrm"
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
_HUB_TIMEOUT_S = 10  # the hub's question whether a model exists, before falling back to the cache


# ------------------------------------------------------------------ what scoring needs besides weights


@dataclasses.dataclass(frozen=True)
class ScoringInfo:
  """What scoring needs besides the weights, as training recorded it.

  Attributes:
    reward_stats: {"mean", "std", "from"} of the rewards on the first validation set when training
      saved the model (``score(normalize=True)``), else None.
    step_separator: the text that ends every step in step scoring (the run's data.step_separator).
    attributes: a regression model's attribute names, one per output, else None.
    training_max_length: the training run's data.max_length, else None (the reward server's
      default limit per item).
    verifier: what an LM head asks (its task's asker): a verifier's question and answers
      (:class:`jaxrm.tasks.verifier.Verifier`) or a pairwise judge's (:class:`jaxrm.tasks.pairwise.Judge`),
      else None.
    task: the name of the model's :mod:`jaxrm.tasks` task, as its files record it; None: not
      known yet (:meth:`with_task` tells it once, from the head, for a model saved before files
      recorded it), or a head that serves no task.
    rendering: how training rendered its rows (:data:`jaxrm.data.tokenize.RENDERINGS`: the chat
      template or plain text), which scoring then renders every input as; None: not recorded (each
      input is rendered as its form says).
  """

  reward_stats: dict[str, Any] | None = None
  step_separator: str = TokenizeOptions.step_separator
  attributes: tuple[str, ...] | None = None
  training_max_length: int | None = None
  verifier: Asker | None = None
  task: str | None = None
  rendering: str | None = None

  @classmethod
  def of_run(
    cls, config: RunConfig | None, meta: dict[str, Any], files: RunFiles | None = None
  ) -> ScoringInfo:
    """Of a training run: its config (None when config.json is missing), a checkpoint's meta and
    what ``model_config.json`` records (``files``)."""
    stats = meta.get("reward_stats") or None
    task = files.task if files is not None else None
    rendering = files.rendering if files is not None else None
    if config is None:
      attributes = task.get("attributes") if task else None
      return cls(
        reward_stats=stats,
        attributes=None if attributes is None else tuple(attributes),
        verifier=recorded_asker(task),
        task=task.get("name") if task else None,
        rendering=rendering,
      )
    return cls(
      reward_stats=stats,
      step_separator=config.data.step_separator,
      attributes=config.reward.attribute_names if config.reward.task.per_attribute else None,
      training_max_length=config.data.max_length,
      # what the run recorded (a judge's template too), else what its config asks
      verifier=recorded_asker(task) or config.reward.verifier,
      task=config.reward.task.name,
      rendering=rendering,
    )

  def with_task(self, config: ModelConfig) -> ScoringInfo:
    """This info with its model's task checked against the head ``config``: the task of its asker
    (a judge's, a verifier's) where it has one, else the one its files record, else told from the
    head once (:func:`jaxrm.tasks.of_model`)."""
    try:
      task = tasks.of_model(config, self.attributes, asker_task(self.verifier) or self.task)
    except ValueError as e:
      raise CheckpointError(str(e)) from None
    return dataclasses.replace(self, task=None if task is None else task.name)

  def task_record(self) -> dict[str, Any] | None:
    """The task as a model's files record it (:func:`jaxrm.run.run_files.task_record`)."""
    return task_record(self.task, self.attributes, self.verifier)

  @classmethod
  def of_export(
    cls, hf_config: dict[str, Any], cfg: ModelConfig, verifier: Asker | None = None
  ) -> ScoringInfo:
    """Of an HF config.json: what an export recorded under :data:`SCORING_KEY`, and the attribute
    names of a regression head (``problem_type``, ``id2label``); ``verifier`` is an LM head's asker."""
    saved = hf_config.get(SCORING_KEY) or {}
    task = saved.get("task")
    if task and (cfg.head, cfg.num_labels) != _saved_head(hf_config):
      task = None  # a new head in place of the saved one: the record is of another model
    if task:
      attributes = tuple(task["attributes"]) if "attributes" in task else None
    else:  # an export written before exports recorded the task
      attributes = hf_export.regression_attributes(hf_config, cfg)
    return cls(
      reward_stats=saved.get("reward_stats") or None,
      step_separator=saved.get("step_separator", TokenizeOptions.step_separator),
      attributes=attributes,
      training_max_length=saved.get("training_max_length"),
      verifier=verifier,
      task=task.get("name") if task else None,
      rendering=saved.get("rendering"),
    )

  def export_entry(self) -> dict[str, Any]:
    """What an export's config.json holds under :data:`SCORING_KEY`."""
    entry = {"reward_stats": self.reward_stats, "step_separator": self.step_separator}
    if self.training_max_length is not None:
      entry["training_max_length"] = int(self.training_max_length)
    if self.task is not None:
      entry["task"] = self.task_record()
    if self.rendering is not None:
      entry["rendering"] = self.rendering
    return entry


def _saved_head(hf_config: dict[str, Any]) -> tuple[str, int]:
  saved = from_hf_config(hf_config)
  return saved.head, saved.num_labels


def recorded_asker(task: dict[str, Any] | None, where: str = "the model's task record") -> Asker | None:
  """The asker a task record holds (:meth:`ScoringInfo.task_record`: a verifier's or a judge's
  question and answers), else None."""
  return asker_of((task or {}).get("verifier"), where)


def asker_of(saved: dict[str, Any] | None, where: str) -> Asker | None:
  """The asker ``saved`` records (its ``to_json``): of the task it names under ``"task"``, a
  verifier's where it names none (files written before judges); None for None."""
  if saved is None:
    return None
  try:
    task = tasks.named(saved["task"], where) if "task" in saved else tasks.first_asker()
    if task.asker is None:
      raise ValueError(f"a {task.name} model asks no question")
    return task.asker.from_json(saved)
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise CheckpointError(f"{where}: not a verifier's or a judge's question and answers ({e})") from None


def asker_task(asker: Any) -> str | None:
  """The name of the task whose asker ``asker`` (or its class) is: a verifier's, a judge's; None
  for None."""
  kind = asker if isinstance(asker, type) else type(asker)
  return next((t.name for t in tasks.TASKS.values() if t.asker and issubclass(kind, t.asker)), None)


@contextlib.contextmanager
def _quiet(logger: str):
  target = logging.getLogger(logger)
  level = target.level
  target.setLevel(logging.ERROR)
  try:
    yield
  finally:
    target.setLevel(level)


def names_gguf(name_or_path: str) -> bool:
  """Whether a model name or path is a GGUF file (or the embedded model, which is one)."""
  return name_or_path.startswith(EMBEDDED_PREFIX) or name_or_path.endswith(".gguf")


# ------------------------------------------------------------------ sources


@dataclasses.dataclass(frozen=True)
class HFSource:
  """An HF checkpoint directory (config.json + safetensors); ``name`` as the user gave it."""

  path: str
  name: str


@dataclasses.dataclass(frozen=True)
class GGUFSource:
  """A ``.gguf`` file (the embedded model is one)."""

  path: str
  name: str


@dataclasses.dataclass(frozen=True)
class RunSource:
  """A training run, and the step to load (named by the path or asked for; None: the best)."""

  files: RunFiles
  step: int | None = None
  checkpoint_dir: str = ""  # where the step's checkpoint lies (default: the run's)

  @property
  def name(self) -> str:
    return self.files.run_dir

  @property
  def checkpoints(self) -> str:
    return self.checkpoint_dir or self.files.checkpoint_dir


Source = HFSource | GGUFSource | RunSource
SOURCES = (HFSource, GGUFSource, RunSource)


def locate(path: str | os.PathLike, step: int | None = None) -> Source:
  """What ``path`` names, as a typed source.

  Args:
    path: an HF checkpoint directory, a ``.gguf`` file, ``embedded:<name>``, a hub name
      (``org/name``, downloaded unless it is a local path), a training output directory, or one of
      its checkpoints (``<output_dir>/checkpoints/<step>``).
    step: which checkpoint of a training run (default: the one the path names, else the best).

  Raises:
    CheckpointError: nothing loadable there (the message says what is).
  """
  name = os.fspath(path)
  local = _resolve(name)
  run = _locate_run(local, step)
  if run is not None:
    return run
  if not os.path.exists(local):
    raise CheckpointError(
      f"{local}: no such file or directory (jaxrm loads HF checkpoint directories, .gguf files, "
      "training output directories and their checkpoints)"
    )
  if step is not None:
    raise CheckpointError(
      f"step={step} selects a checkpoint of a training output directory, but "
      f"{local} is not one (no {RUN_MODEL_CONFIG})"
    )
  if local.endswith(".gguf") and os.path.isfile(local):
    return GGUFSource(local, name)
  if os.path.isdir(local):
    return HFSource(local, name)
  raise CheckpointError(f"{local}: not a checkpoint directory or a .gguf file")


def as_source(path: str | os.PathLike | Source, step: int | None = None) -> Source:
  """``path`` located (:func:`locate`), or a source already located, given as it is."""
  if not isinstance(path, SOURCES):
    return locate(path, step)
  if step is not None:
    raise ValueError(f"step={step} with a located source: pass it to locate(path, step) instead")
  return path


def _resolve(name: str) -> str:
  """``embedded:...`` -> the packaged GGUF; a hub name that is no local path -> its snapshot."""
  if name.startswith(EMBEDDED_PREFIX):
    from jaxrm.hf.gguf import embedded_model_path

    return embedded_model_path()
  if not os.path.exists(name) and name.count("/") == 1 and not name.startswith((".", "/")):
    try:
      return _hub_snapshot(name)
    except Exception as e:  # offline, unknown repo, gated...
      raise CheckpointError(
        f"{name}: no such file or folder ({os.path.abspath(name)}), and as a hub model name it "
        f"could not be fetched: {_hub_failure(e)}"
      ) from None
  return name


def _hub_snapshot(name: str) -> str:
  """The local snapshot of hub model ``name``, downloaded when the hub has it.

  The hub is asked once, without retries (its client retries a network error, with a warning
  each time); when it gives no answer, the local hub cache does, else the question's error is
  raised. The hub client's own warnings stay quiet: the error says what went wrong.
  """
  from huggingface_hub import HfApi, snapshot_download

  with _quiet("huggingface_hub"):
    try:
      HfApi().model_info(name, timeout=_HUB_TIMEOUT_S)
    except Exception as asked:  # noqa: BLE001 -- offline, unknown, gated: the cache may still hold it
      try:
        return snapshot_download(name, allow_patterns=_HUB_FILES, local_files_only=True)
      except Exception:  # noqa: BLE001 -- not cached: the hub's answer says why
        raise asked from None
    return snapshot_download(name, allow_patterns=_HUB_FILES)


def _hub_failure(e: Exception) -> str:
  """Why the hub gave no model, in a few words (one line)."""
  from huggingface_hub import errors

  if isinstance(e, errors.GatedRepoError):
    return "the repository is gated; log in with an account that has access (hf auth login)"
  if isinstance(e, errors.RepositoryNotFoundError):
    return "the hub has no such repository (or it is private; log in with hf auth login)"
  status = getattr(getattr(e, "response", None), "status_code", None)
  if isinstance(e, errors.HfHubHTTPError) and status is not None:
    return f"the hub answered HTTP {status}, and the model is not in the local hub cache"
  cause = (e.__cause__ or e.__context__) if isinstance(e, errors.LocalEntryNotFoundError) else e
  why = f" ({type(cause).__name__}: {_first_line(str(cause))})" if cause is not None else ""
  return f"the hub is unreachable from here{why}, and the model is not in the local hub cache"


def _first_line(text: str) -> str:
  return text.strip().splitlines()[0] if text.strip() else ""


def _locate_run(path: str, step: int | None) -> RunSource | None:
  if is_run_dir(path):
    return RunSource(RunFiles.read(path), step)
  norm = os.path.normpath(os.path.abspath(path))
  named = os.path.basename(norm)
  if not (named.isdigit() and os.path.isdir(os.path.join(norm, "params"))):
    return None
  checkpoint_dir = os.path.dirname(norm)
  run_dir = os.path.dirname(checkpoint_dir)
  if not is_run_dir(run_dir):
    raise CheckpointError(
      f"{path} is a training checkpoint, but {run_dir} has no {RUN_MODEL_CONFIG}; load the run's "
      f"output directory (the one holding {RUN_MODEL_CONFIG}) with step={named}"
    )
  if step is not None and step != int(named):
    raise CheckpointError(
      f"{checkpoint_dir}/{named} is the checkpoint of step {named}, but step={step} "
      "was asked for; pass one or the other"
    )
  return RunSource(RunFiles.read(run_dir), int(named), checkpoint_dir)


def tensors_of(source: Source):
  """The tensor reader of an HF directory or GGUF file (``config``, ``keys()``, ``get_tensor()``)."""
  if isinstance(source, GGUFSource):
    from jaxrm.hf.gguf import GGUFCheckpoint

    return GGUFCheckpoint(source.path)
  if isinstance(source, HFSource):
    from jaxrm.hf.safetensors_io import HFCheckpoint

    return HFCheckpoint(source.path)
  raise CheckpointError(f"{source.name} is a jaxrm training run, not an HF checkpoint or .gguf file")


# ------------------------------------------------------------------ loading


class Loaded(NamedTuple):
  """A loaded model (``flax.nnx.Module``), its tokenizer (or None) and its scoring info."""

  model: Decoder
  tokenizer: Any
  info: ScoringInfo

  @property
  def config(self) -> ModelConfig:
    return self.model.config


def load(
  source: Source,
  overrides: dict[str, Any] | None = None,
  *,
  head: str | None = None,
  num_labels: int | None = None,
  mesh: Mesh | None = None,
  seed: int = 0,
  tokenizer: Any = None,
  weights: bool = True,
  verifier: Asker | None = None,
  asks: type | None = None,
) -> Loaded:
  """The model ``source`` holds, with its tokenizer and scoring info.

  Args:
    source: from :func:`locate`.
    overrides: ModelConfig fields to set (``dtype``, ``param_dtype``, ``remat``, ``lora``...).
    head: "sequence", "token" or "lm" (a verifier's): an HF checkpoint gets a new head of this kind unless it
      has one; a training run must have been trained with it.
    num_labels: labels of a new head (default 1 for sequence, 2 for token heads).
    mesh: place parameters sharded over this mesh (default: the first device).
    seed: seed of a new head and of new LoRA adapters.
    tokenizer: use this tokenizer instead of the source's.
    weights: False reads no tensors and opens no checkpoint: the model's parameters are
      ``jax.ShapeDtypeStruct``s with the shardings they would have on ``mesh``.
    verifier: load a causal LM as a verifier asking this question (:mod:`jaxrm.tasks.verifier`), or as
      the pairwise judge a :class:`~jaxrm.tasks.pairwise.Judge` is; an export of either (its
      ``jaxrm_verifier.json``) and a training run of one are one without it, asking theirs.
      ``head="lm"`` alone: whatever the files record, else a verifier's defaults.
    asks: with ``head="lm"`` and no ``verifier``, the kind of asker wanted (``Verifier`` or
      ``Judge``): the one the files record if it is of this kind, else its defaults.
  """
  overrides = dict(overrides or {})
  if isinstance(source, RunSource):
    return _load_run(source, overrides, head, num_labels, mesh, tokenizer, weights, verifier, asks)
  tensors = tensors_of(source)
  if verifier is None and head in (None, "lm") and isinstance(source, HFSource):
    # an export of a verifier or a judge asks what it recorded
    path = os.path.join(source.path, askers.FILE)
    verifier = asker_of(askers.read_record(source.path), path) or recorded_asker(
      (tensors.config.get(SCORING_KEY) or {}).get("task")
    )
  if head == "lm" and asks is not None and not isinstance(verifier, asks):
    verifier = asks()
  if verifier is None and head == "lm":
    verifier = tasks.first_asker().asker()  # a verifier's defaults
  if tokenizer is None:
    tokenizer = tensors.tokenizer() if hasattr(tensors, "tokenizer") else _tokenizer_from_dir(source.path)
  saved = from_hf_config(tensors.config)
  if verifier is not None:
    head_overrides = _verifier_overrides(verifier, tokenizer, num_labels, source.name)
  else:
    head_overrides = _head_overrides(head, num_labels)
  cfg = from_hf_config(tensors.config, **(overrides | head_overrides))
  model = _model(cfg, tensors, saved, mesh, seed) if weights else placed_abstract_model(cfg, mesh)
  if tokenizer is not None and cfg.pad_token_id is None and tokenizer.pad_token_id is not None:
    model.config = cfg.replace(pad_token_id=tokenizer.pad_token_id)
  info = ScoringInfo.of_export(tensors.config, model.config, verifier)
  return Loaded(model, tokenizer, info.with_task(model.config))


def _verifier_overrides(verifier: Asker, tokenizer, num_labels: int | None, name: str) -> dict[str, Any]:
  """Config changes that make a causal LM a verifier (or a judge) of ``verifier``'s answers."""
  what = verifier.NOUN
  if tokenizer is None:
    raise CheckpointError(
      f"{name} has no tokenizer: {what} needs one to find its answers' tokens and to lay out "
      "its question (pass tokenizer=)"
    )
  if num_labels not in (None, 1):
    raise ConfigError(f"num_labels={num_labels}: {what} gives one score per row (its answers' log-odds)")
  return dict(head="lm", head_bias=False, num_labels=1, verifier_tokens=verifier.token_ids(tokenizer))


def _head_overrides(head: str | None, num_labels: int | None) -> dict[str, Any]:
  """Config changes that give an HF checkpoint a (new) ``head`` with ``num_labels`` labels."""
  if head is not None:
    return dict(head=head, head_bias=head == "token", num_labels=num_labels or (2 if head == "token" else 1))
  return {} if num_labels is None else dict(num_labels=num_labels)


def _model(cfg: ModelConfig, tensors, saved: ModelConfig, mesh: Mesh | None, seed: int) -> Decoder:
  """``tensors``' weights in a model of ``cfg``; a new head where ``cfg``'s differs from the saved one."""
  new_head = (saved.head, saved.num_labels) != (cfg.head, cfg.num_labels)
  return load_model(cfg, tensors, mesh=mesh, seed=seed, new_head=new_head)


def _load_run(
  source: RunSource,
  overrides,
  head,
  num_labels,
  mesh,
  tokenizer,
  weights: bool,
  verifier: Asker | None,
  asks: type | None = None,
) -> Loaded:
  files = source.files
  cfg = files.model_config
  if verifier is not None:
    head = "lm"
    asks = type(verifier)
  for name, wanted in (("head", head), ("num_labels", num_labels), ("lora", overrides.get("lora"))):
    if wanted is not None and wanted != getattr(cfg, name):
      raise CheckpointError(
        f"{files.run_dir} was trained with {name}={getattr(cfg, name)!r}; "
        f"it cannot be loaded with {name}={wanted!r}"
      )
  cfg = cfg.replace(**overrides)
  meta: dict[str, Any] = {}
  if not weights:
    model = placed_abstract_model(cfg, mesh)
  else:
    model, meta = _restore(
      source, _lora_base(files, cfg, mesh) if cfg.lora.enabled else placed_abstract_model(cfg, mesh)
    )
  if tokenizer is None:
    tokenizer = _tokenizer_from_dir(files.tokenizer_dir)
  info = ScoringInfo.of_run(files.run_config, meta, files)
  if asks is not None and info.verifier is not None and not isinstance(info.verifier, asks):
    raise CheckpointError(
      f"{files.run_dir} was trained as a {info.task} model; it cannot be loaded as a "
      f"{asker_task(asks)} model (leave verifier= and judge= out: it asks what it was trained to)"
    )
  if verifier is not None:  # the run's answers, another question
    if info.verifier is not None and verifier.answers != info.verifier.answers:
      raise CheckpointError(
        f"{files.run_dir} was trained as a {info.task} answering {'/'.join(info.verifier.answers)}; "
        f"it cannot be loaded answering {'/'.join(verifier.answers)}"
      )
    info = dataclasses.replace(info, verifier=verifier)
  return Loaded(model, tokenizer, info.with_task(model.config))


def _lora_base(files: RunFiles, cfg: ModelConfig, mesh: Mesh | None) -> Decoder:
  """A LoRA run's model before its checkpoint: the base it trained over, with new adapters."""
  if not files.base_model:
    raise CheckpointError(
      f"{files.run_dir}: {RUN_MODEL_CONFIG} names no base model for the LoRA adapters "
      "(and config.json has no model.name_or_path)"
    )
  try:
    base = locate(files.base_model)
    tensors = tensors_of(base)
  except CheckpointError as e:
    raise CheckpointError(
      f"{files.run_dir} holds LoRA adapters over {files.base_model}, which cannot be read: {e}"
    ) from None
  return _model(cfg, tensors, from_hf_config(tensors.config), mesh, seed=0)


def _restore(source: RunSource, model: Decoder) -> tuple[Decoder, dict]:
  """``model`` with the trained parameters of ``source``'s checkpoint (a LoRA run's: its adapters
  and head, over the base already in ``model``), and the checkpoint's meta."""
  cfg = model.config
  graphdef, state = nnx.split(model)
  if cfg.lora.enabled:
    trained, frozen = nnx.split_state(state, lora.trainable_filter(cfg.lora), ...)
    parts = (trained, frozen)
  else:
    trained, parts = state, (state,)
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), nnx.to_pure_dict(trained)
  )
  params, meta = _restore_params(source, target)
  nnx.replace_by_pure_dict(trained, params)
  return nnx.merge(graphdef, *parts), meta


def _restore_params(source: RunSource, target: dict) -> tuple[dict, dict]:
  directory = source.checkpoints
  ckpt = _checkpointer(source)
  try:
    choice = _choose(ckpt, source)
    if source.step is None:  # chosen here: say which
      log.info("%s", choice.describe())
    try:
      return ckpt.restore_params(choice.step, target)
    except checkpointing.DamagedCheckpointError as e:
      others = [s for s in choice.steps if s != choice.step]
      raise CheckpointError(
        f"{e}. Load another checkpoint with step=N ({'available: ' + ', '.join(map(str, others)) if others else 'there is no other'}), "
        f"or remove {os.path.join(directory, str(choice.step))}"
      ) from None
  finally:
    ckpt.close()


@dataclasses.dataclass(frozen=True)
class CheckpointChoice:
  """The checkpoint of a training run that loading takes, and why.

  Attributes:
    run_dir: the run's output directory.
    step: the step loaded.
    why: why this one ("the best by validation-default_loss = 0.41 (lowest)", "the latest...",
      "as asked").
    steps: every complete checkpoint's step, in order.
  """

  run_dir: str
  step: int
  why: str
  steps: tuple[int, ...]

  def describe(self, how: str = "step=N") -> str:
    """One line: the step, why, and the other steps (chosen with ``how``)."""
    others = [s for s in self.steps if s != self.step]
    rest = f"; other steps: {', '.join(map(str, others))} (choose one with {how})" if others else ""
    return f"checkpoint: step {self.step} of {self.run_dir}, {self.why}{rest}"


def choose_checkpoint(source: RunSource) -> CheckpointChoice:
  """The checkpoint of ``source`` that :func:`load` takes: its step (asked for, or named by the
  path), else the best by the run's metric, else the latest.

  Raises:
    CheckpointError: no checkpoint, or none for the step asked for (the message lists the steps).
  """
  ckpt = _checkpointer(source)
  try:
    return _choose(ckpt, source)
  finally:
    ckpt.close()


def _checkpointer(source: RunSource) -> checkpointing.Checkpointer:
  directory = source.checkpoints
  if not os.path.isdir(directory):
    raise CheckpointError(
      f"{source.files.run_dir}: no checkpoint directory {directory} "
      "(training writes checkpoints there when checkpointing.enabled is true)"
    )
  spec = source.files.run_config.checkpointing if source.files.run_config is not None else None
  return checkpointing.Checkpointer(
    directory,
    metric_name=spec.metric if spec else None,
    higher_is_better=spec.higher_is_better if spec else False,
  )


def _choose(ckpt: checkpointing.Checkpointer, source: RunSource) -> CheckpointChoice:
  steps = tuple(ckpt.all_steps())
  if not steps:
    raise CheckpointError(
      f"{ckpt.directory}: no complete checkpoint yet (training saves one every "
      "checkpointing.save_period steps and at the end)"
    )
  if source.step is not None:
    step, why = source.step, "as asked"
  else:
    step, why = _best(ckpt)
  if step not in steps:
    raise CheckpointError(
      f"{ckpt.directory}: no checkpoint for step {step}; available steps: {', '.join(map(str, steps))}"
    )
  if step == steps[-1] and source.step is None and not why.startswith("the latest"):
    why += ", also the latest"
  return CheckpointChoice(source.files.run_dir, step, why, steps)


def _best(ckpt: checkpointing.Checkpointer) -> tuple[int, str]:
  """The best step and why: as ``best_checkpoint.json`` records it, else Orbax's best by the run's
  metric, else the latest."""
  best = checkpointing.read_best(ckpt.directory)
  if best is not None:
    metric, value = best.get("metric_name"), best.get("value")
    ranked = (metric, value, bool(best.get("higher_is_better"))) if metric and value is not None else None
    return int(best["step"]), _why(ranked, metric)
  ranked = ckpt.best_by_metric()
  if ranked is not None:
    return ranked[0], _why((ckpt.metric_name, ranked[1], ckpt.higher_is_better), ckpt.metric_name)
  return ckpt.latest_step(), _why(None, ckpt.metric_name)


def _why(ranked: tuple[str, float, bool] | None, metric: str | None) -> str:
  if ranked is not None:
    name, value, higher = ranked
    return f"the best by {name} = {value:.4g} ({'highest' if higher else 'lowest'})"
  if metric:
    return f"the latest (no checkpoint has a {metric} to rank it by)"
  return "the latest (the run ranks checkpoints by no metric: checkpointing.metric_name is empty)"


def _tokenizer_from_dir(path: str):
  from transformers import AutoTokenizer

  if not any(
    os.path.exists(os.path.join(path, f))
    for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
  ):
    log.warning("%s has no tokenizer files; rm.tokenizer is None", path)
    return None
  return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
