"""The shape of a reward task: what every task in this package says of itself (:class:`Task`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrm.data import example_types
from jaxrm.data.example_types import ExampleType
from jaxrm.tasks import losses
from jaxrm.tasks.routes import Route


@dataclasses.dataclass(frozen=True, eq=False)  # one object per task, compared by identity
class Task:
  """One kind of reward model: how it is trained, and what its head is."""

  name: str  # the model kind: RewardModel.kind, and what jaxrm.scoring.kinds.check_kind is asked for
  reward_types: tuple[str, ...]  # the reward.type values that train it
  data: str  # the rows it reads, as its datasets hold them (jaxrm.data.registry.rows_of)
  dataset: str  # the dataset (data.dataset_name) that reads a user's own files of its rows
  # The tokenized rows it trains on (how each is batched and packed): its data's first; a
  # verifier's preference files may hold labelled items instead of pairs.
  example_types: tuple[ExampleType, ...]
  # how jaxrm.evaluate reads and scores its data: its key in jaxrm.evaluation.readings.READINGS (an
  # evaluation result's "kind")
  evaluation: str
  # How jaxrm.evaluate scores and reports its reading `evaluation` where jaxrm.evaluation.readings
  # does not score it itself (a judge's pairs, each in both orders); None: the readings' own.
  evaluation_scoring: ReadingScoring | None = dataclasses.field(default=None, kw_only=True)
  # How the benchmarks score a model of it that compares two responses instead of scoring each (a
  # judge's pairs in both orders, a group's rewards from its comparisons); None: one reward per
  # conversation, or its steps' probabilities, as `scores` says.
  benchmark_scoring: BenchmarkScoring | None = dataclasses.field(default=None, kw_only=True)
  # data.packing -> the batch class its rows are collated into; a mode left out is refused
  batches: Mapping[str, type]
  packing_refused: str  # why a data.packing left out of `batches` is refused ({packing}: the mode)
  # "sequence" (one output vector per row) | "token" (one per token) | "lm" (a verifier's: one
  # log-odds per row, from the LM head)
  head: str
  # What scoring a model of it returns (one of SCORES): "reward" (one per row), "steps" (a
  # probability per step), "attributes" (one prediction per rated attribute), "comparisons" (which
  # of two responses is better; a group's rewards come from them).
  scores: str
  num_labels: int | None  # the head's outputs; None: one per rated attribute (reward.attributes)
  # RewardSpec.loss_key -> fn(spec, outputs, batch) -> (loss, metrics)
  losses: Mapping[tuple[str, str | None], losses.SpecLoss]
  # validation's metrics that need the whole set: fn(spec, outputs, batch) -> {"samples": ...}
  samples: losses.SpecMetrics | None
  # fn(spec) -> (outputs, batch) of one tiny unpacked batch: what the loss's metrics are named
  example: Callable[[Any], tuple[np.ndarray, Any]]
  # The wrong-model message (jaxrm.scoring.kinds.check_kind): what a use of this task needs, how to train
  # a model of it, and what a model of it is used for instead (None: the message says how to train
  # the model the use wants).
  needs: str
  train: str
  use_instead: str | None = None
  # The RewardSpec key that picks one of several losses (its value is the second part of the
  # loss key), or None.
  loss_choice: str | None = None
  # The reward section's keys of its own (jaxrm.config.RewardSpec is built with them): reward.<key>
  # -> (its default, what it means, as the config reference shows it); one set for a reward.type of
  # another task is refused. None: its asker's (the asker class's SETTINGS: a judge's question and
  # answers), none without one.
  settings: Mapping[str, tuple[str, str]] | None = None
  # The other tasks' uses (their names) that a model of this task serves too: a verifier's one
  # reward per row serves wherever a preference model's does.
  serves: tuple[str, ...] = ()
  # How an RL reward function (jaxrm.scoring.reward_funcs, jaxrm.integrations.verl) rewards a batch of
  # completions with a model of it whose scores are not one per completion (a judge's: each
  # prompt's completions compared): an object with OPTIONS (the reward functions' options that ask
  # for it, with their defaults), FOR and OWNER (what messages call who takes them), ROUTE (the
  # server's route), COLUMN (the batch's column of reference answers), settings(given, others),
  # against_reference(given), local(rm, prompts, completions, columns, settings, batch_size) and
  # remote(post, prompts, completions, columns, settings) (jaxrm.tasks.pairwise.GroupRewards);
  # None: one score per completion.
  group_rewards: Any = None
  # The LM-head asker of a model of this task (a verifier's question and answers, a judge's): a
  # class with of_spec(reward spec), from_json(record), to_json(), token_ids(tokenizer),
  # tokenize_options(options), NOUN (what messages call its model: "a judge"), WORD (its keyword in
  # from_pretrained), its reward keys (SETTINGS), its command-line flags (SWITCH, FLAGS) and
  # check_tokenizer (what a run checks before any weight is read, or None); None: the task's head
  # is not the LM head.
  asker: type | None = None
  # The server routes a model of it adds (jaxrm.server.formats.ROUTES holds every task's): POST
  # path -> its Route (jaxrm.tasks.routes: the body parsed into the rows to score and how the answer is
  # written, what the route does, the counters /metrics keeps of it); a model of another task is
  # refused there (400).
  routes: Mapping[str, Route] = dataclasses.field(default_factory=dict)
  # What the server's one-reward routes (/score, /reward, ...) answer a model of it that gives no
  # reward per row, after "{path} gives one reward per item, and this server's model is ": what it
  # is, and the route to send instead. None: they serve it.
  route_instead: str | None = None
  # The Python lines that use a loaded model of it besides what scores one reward per row (a
  # judge's comparisons): a run's end-of-run "use it" lines hold them (jaxrm.run.report.usage_commands).
  uses: tuple[str, ...] = ()
  # What a loaded model of it does beyond what every RewardModel does (a judge's compare,
  # score_group, score_groups, judge_text): name -> fn(rm, *args, **kwargs), found as rm.<name>
  # (jaxrm.tasks.verb); a property's fget(rm) is read as the attribute rm.<name> (a judge's asker,
  # rm.judge). Called on a model of another task, a verb refuses it in its own words.
  verbs: Mapping[str, Callable[..., Any] | property] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.settings is None:
      object.__setattr__(self, "settings", {} if self.asker is None else dict(self.asker.SETTINGS))

  @property
  def labelled(self) -> bool:
    """Whether it also trains on labelled items (prompt, completion, good or bad: a
    LabelledBatch), which a preference file may hold instead of pairs."""
    return example_types.LABELLED in self.example_types

  @property
  def evaluations(self) -> dict[str, ExampleType]:
    """Its readings of evaluation data (keys of :data:`jaxrm.evaluation.readings.READINGS`) -> the
    rows each reads: its data under :attr:`evaluation`, and each other sort of row it trains on (a
    verifier's labelled items) under that row's own key."""
    first, *others = self.example_types
    return {self.evaluation: first, **{rows.key: rows for rows in others}}

  @property
  def per_attribute(self) -> bool:
    """Whether the head has one output per rated attribute (``reward.attributes``)."""
    return self.num_labels is None

  def loss_key(self, reward_type: str, choice: str) -> tuple[str, str | None]:
    """The key in :attr:`losses` of a reward spec: ``choice`` (the value of its
    :attr:`loss_choice` key) counts where it names one."""
    return (reward_type, choice) if (reward_type, choice) in self.losses else (reward_type, None)


@dataclasses.dataclass(frozen=True)
class ReadingScoring:
  """How :func:`jaxrm.evaluation.evaluate` scores and reports a task's own reading of evaluation data
  (:attr:`Task.evaluation_scoring`): what it keeps of the model's outputs, its metrics over any
  subset of the rows, and its report's lines, subset columns and histograms."""

  use: str  # what needs the model, as the wrong-model message names it
  # (outputs, examples) -> (arrays for `metrics`, the scores an evaluation result keeps by name);
  # outputs(width) is float32 [rows of the eval batches, width]: each row's output(s) in order, 0
  # for a row without tokens
  score: Callable[[Callable[[int], np.ndarray], list], tuple[Any, dict[str, Any]]]
  metrics: Callable[[Any, np.ndarray], dict[str, float]]  # (arrays, example mask [N]) -> metrics
  lines: Callable[[dict[str, Any]], list[str]]  # result -> the report's headline lines
  columns: Callable[[dict[str, Any]], tuple[str, ...]]  # result -> the subset table's metrics
  # result -> its scores' plot: ([(label, values [n])], the x axis's label, the title)
  histograms: Callable[[dict[str, Any]], tuple[Sequence[tuple[str, np.ndarray]], str, str]]


@dataclasses.dataclass(frozen=True)
class BenchmarkScoring:
  """How the benchmarks (:mod:`jaxrm.benchmarks`) score a model that compares two responses
  (:attr:`Task.benchmark_scoring`): its log-odds of pairs, a group's rewards, and the figures and
  report lines of pairs asked in both orders."""

  # (rm, prompts, responses A, responses B, batch_size, max_length) -> float [N]: the log-odds that
  # A is the better response, each pair in the order given (an EvaluationError for a text too long)
  pairs: Callable[[Any, Sequence[Any], Sequence[Any], Sequence[Any], int, int], np.ndarray]
  # (rm, prompts, each prompt's responses, batch_size, max_length) -> each group's rewards [n_g]
  groups: Callable[[Any, Sequence[Any], Sequence[Sequence[Any]], int, int], list[np.ndarray]]
  # (log-odds with the better response shown as A [N], shown as B [N]) -> the figures of those
  # pairs asked in both orders (a report's "judge" figures)
  figures: Callable[[np.ndarray, np.ndarray], dict[str, float]]
  # (figures, what the benchmark counts as right) -> the report's line of them
  line: Callable[[dict[str, float], str], str]
  groups_note: str  # how `groups` gives a group's rewards, as a report says it (RewardBench 2's)


SCORES = ("reward", "steps", "attributes", "comparisons")


def ones(n: int) -> np.ndarray:
  """float32 [n] of ones: the masks of a task's example batch."""
  return np.ones(n, np.float32)
