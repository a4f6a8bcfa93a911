"""A training run's output directory: its layout, and reading and writing what its files say.

A run's output directory holds ``config.json`` (its :class:`~jaxrm.config.RunConfig`),
``model_config.json`` (the :class:`~jaxrm.models.config.ModelConfig`, its HF form, a LoRA run's
frozen base, the task trained and how training rendered its rows), ``tokenizer/`` and the Orbax
checkpoint directory (``checkpoints/`` unless ``checkpointing.checkpoint_dir``); it is read and
written through :class:`RunFiles` alone. A LoRA run's checkpoints hold only its adapters and head:
its base stays where it trained from (:func:`base_reference`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from jaxrm.config import RunConfig
from jaxrm.data.tokenize import record_rendering
from jaxrm.errors import CheckpointError, UserError
from jaxrm.models.config import ModelConfig, config_from_dict, to_hf_config

log = logging.getLogger(__name__)

RUN_CONFIG = "config.json"
RUN_MODEL_CONFIG = "model_config.json"
RUN_TOKENIZER_DIR = "tokenizer"


def is_run_dir(path: str) -> bool:
  """Whether ``path`` is a training output directory (it holds ``model_config.json``)."""
  return os.path.isfile(os.path.join(path, RUN_MODEL_CONFIG))


@dataclasses.dataclass(frozen=True)
class RunFiles:
  """A training run's output directory and what its files say.

  Attributes:
    run_dir: the output directory.
    model_config: the model trained (``model_config.json``).
    run_config: the training config (``config.json``); None when that file is missing.
    base_model: a LoRA run's frozen base (an absolute local path, or a hub or embedded name),
      whose weights its checkpoints leave out; None for other runs.
    task: the task trained (:func:`task_record`: its name, attribute names or an LM head's
      question and answers); None: not recorded (a run written before runs recorded it).
      :meth:`write` records the run config's.
    rendering: how training rendered its rows (:data:`jaxrm.data.tokenize.RENDERINGS`); None:
      not recorded. :meth:`write` records that of the first training row.
  """

  run_dir: str
  model_config: ModelConfig
  run_config: RunConfig | None = None
  base_model: str | None = None
  task: dict[str, Any] | None = None
  rendering: str | None = None

  @property
  def checkpoint_dir(self) -> str:
    custom = self.run_config.checkpointing.checkpoint_dir if self.run_config is not None else ""
    return custom or os.path.join(self.run_dir, "checkpoints")

  @property
  def tokenizer_dir(self) -> str:
    return os.path.join(self.run_dir, RUN_TOKENIZER_DIR)

  @classmethod
  def find(cls, run_dir: str) -> RunFiles | None:
    """The files of the run in ``run_dir``; None when no run is there (yet)."""
    return cls.read(run_dir) if is_run_dir(run_dir) else None

  @classmethod
  def read(cls, run_dir: str) -> RunFiles:
    path = os.path.join(run_dir, RUN_MODEL_CONFIG)
    with open(path) as f:
      saved = json.load(f)
    base = saved.get("base_model")
    run_config = _read_run_config(run_dir)
    model_config = config_from_dict(saved["jaxrm"], path)
    if model_config.lora.enabled and not base:
      base = run_config.model.name_or_path if run_config is not None else None
    return cls(run_dir, model_config, run_config, base, saved.get("task"), saved.get("rendering"))

  def write(self, tokenizer: Any) -> None:
    """Writes ``config.json``, ``model_config.json`` and (unless a resumed run already saved it)
    ``tokenizer/``."""
    if self.run_config is not None:
      with open(os.path.join(self.run_dir, RUN_CONFIG), "w") as f:
        json.dump(self.run_config.to_dict(), f, indent=2)
    saved = {"jaxrm": dataclasses.asdict(self.model_config), "hf": to_hf_config(self.model_config)}
    if self.base_model is not None:
      saved["base_model"] = self.base_model
    task, rendering = self.task, self.rendering
    if self.run_config is not None:
      reward = self.run_config.reward
      attributes = reward.attribute_names if reward.task.per_attribute else None
      task = task or task_record(reward.task.name, attributes, reward.verifier)
      rendering = rendering or training_rendering(self.run_config)
    saved.update({k: v for k, v in (("task", task), ("rendering", rendering)) if v is not None})
    with open(os.path.join(self.run_dir, RUN_MODEL_CONFIG), "w") as f:
      json.dump(saved, f, indent=2)
    if not os.path.isdir(self.tokenizer_dir):
      tokenizer.save_pretrained(self.tokenizer_dir)


def training_rendering(config: RunConfig) -> str | None:
  """How a run renders its rows (:func:`jaxrm.data.tokenize.record_rendering`): as its first
  training record's form says; None when that record cannot be read here."""
  from jaxrm.data import registry
  from jaxrm.data.drops import DropReport

  spec = config.data
  options = {}
  if registry.takes_option(spec.dataset_name, "attributes"):
    options["attributes"] = config.reward.attribute_names
  records = registry.iter_records(
    spec.dataset_name, spec.train_data_path or None, drops=DropReport(), **options
  )
  try:
    return record_rendering(next(records))
  except Exception as e:  # noqa: BLE001 -- the run reads its data itself and says what is wrong
    log.warning("the run's rendering is not recorded: its first training row could not be read (%s)", e)
    return None
  finally:
    records.close()


def _read_run_config(run_dir: str) -> RunConfig | None:
  path = os.path.join(run_dir, RUN_CONFIG)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    settings = json.load(f)
  config_log = logging.getLogger("jaxrm.config")
  level = config_log.level
  config_log.setLevel(logging.ERROR)  # its warnings were said when the run started
  try:
    return RunConfig.from_dict(settings)
  except (UserError, TypeError) as e:
    raise CheckpointError(f"{path}: not a training config this version of jaxrm reads: {e}") from None
  finally:
    config_log.setLevel(level)


def base_reference(name_or_path: str) -> str:
  """How a LoRA run names its base: a local path made absolute, a hub or embedded name as given."""
  return os.path.abspath(name_or_path) if os.path.exists(name_or_path) else name_or_path


def task_record(
  name: str | None, attributes: tuple[str, ...] | None = None, verifier: Any = None
) -> dict[str, Any] | None:
  """The task as a model's files (a run's ``model_config.json``, an export's config.json) record
  it: its name, with a regression model's attribute names or what an LM head asks (``verifier``,
  the task's asker: a verifier's question and answers, a pairwise judge's with its template) under
  ``"verifier"``, as the asker's ``to_json`` gives it; None for a model of no task."""
  if name is None:
    return None
  record: dict[str, Any] = {"name": name}
  if attributes is not None:
    record["attributes"] = list(attributes)
  if verifier is not None:
    record["verifier"] = verifier.to_json()
  return record
