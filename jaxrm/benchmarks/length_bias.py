"""Length bias of a preference evaluation: does the reward follow the response's length?

The benchmarks measure lengths in characters of the response text, so that they do not depend on
the tokenizer; token-id data is measured in tokens. Each evaluation gives its (chosen, rejected)
comparisons as :class:`Comparisons`; the report has the
Spearman correlation of reward with length over every scored response, and the accuracy of the
comparisons where the chosen response is the longer one, the shorter one, or as long.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

PLOT_FILE = "length_bias.png"


@dataclasses.dataclass(frozen=True)
class Comparisons:
  """Pairs of scored responses, the chosen one meant to win: rewards and lengths float [P].

  ``responses`` holds the reward and length of every distinct scored response once ([R, 2]), for
  the correlation; a response compared several times (best-of-N) appears once there.
  """

  chosen_reward: np.ndarray
  rejected_reward: np.ndarray
  chosen_length: np.ndarray
  rejected_length: np.ndarray
  responses: np.ndarray  # [R, 2]: reward, length
  chosen_responses: np.ndarray  # [R] bool: whether each response is a chosen one


def comparisons(
  pairs: list[tuple[float, int, float, int]], responses: list[tuple[float, int, bool]]
) -> Comparisons:
  """From ``(chosen reward, chosen length, rejected reward, rejected length)`` pairs and the
  ``(reward, length, is chosen)`` of every scored response."""
  p = np.asarray(pairs, np.float64).reshape(-1, 4)
  r = np.asarray(responses, np.float64).reshape(-1, 3)
  return Comparisons(p[:, 0], p[:, 2], p[:, 1], p[:, 3], r[:, :2], r[:, 2] > 0)


def report(c: Comparisons, unit: str = "characters") -> dict[str, Any]:
  """``{"unit", "spearman": {...}, "chosen_longer" | "chosen_shorter" | "same_length": {...}}``."""
  from scipy import stats

  rewards, lengths = c.responses[:, 0], c.responses[:, 1]
  varied = len(rewards) > 1 and np.ptp(rewards) > 0 and np.ptp(lengths) > 0
  rho, p_value = stats.spearmanr(rewards, lengths) if varied else (math.nan, math.nan)
  right = c.chosen_reward > c.rejected_reward
  out = {
    "unit": unit,
    "spearman": {"rho": float(rho), "p_value": float(p_value), "num_responses": len(rewards)},
  }
  for name, where in (
    ("chosen_longer", c.chosen_length > c.rejected_length),
    ("chosen_shorter", c.chosen_length < c.rejected_length),
    ("same_length", c.chosen_length == c.rejected_length),
  ):
    out[name] = {
      "accuracy": float(right[where].mean()) if where.any() else math.nan,
      "num_pairs": int(where.sum()),
    }
  return out


def format_report(bias: dict[str, Any]) -> str:
  """The length-bias lines the CLI prints."""
  s = bias["spearman"]
  lines = [
    f"length bias ({bias['unit']}): Spearman rho(reward, length) {s['rho']:.3f} over "
    f"{s['num_responses']} responses"
  ]
  for name, label in (
    ("chosen_longer", "chosen longer"),
    ("chosen_shorter", "chosen shorter"),
    ("same_length", "same length"),
  ):
    lines.append(
      f"  accuracy when {label:<14} {_pct(bias[name]['accuracy']):>6}  ({bias[name]['num_pairs']} pairs)"
    )
  for category, slice_ in bias.get("length_categories", {}).items():
    if slice_["num_pairs"]:
      lines.append(
        f"  length category {category:<8} {_pct(slice_['accuracy']):>6}  "
        f"({slice_['num_pairs']} pairs; {slice_['meaning']})"
      )
  return "\n".join(lines)


def _pct(x: float) -> str:
  return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def plot(c: Comparisons, path: str, title: str, unit: str = "characters") -> None:
  """Writes a PNG of reward against response length (:func:`draw`)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(7, 4.5))
  FigureCanvasAgg(fig)
  draw(c, fig.add_subplot(), title, unit)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


# Lengths spanning more than this factor get a log axis; closer ones (short responses, say 2 to 5
# tokens) a linear one, where every length can carry its own label.
LOG_SPAN = 20.0
# How far chosen and rejected responses of one length sit either side of it: a fraction of the
# gap between neighbouring lengths (linear axis), or a factor (log axis).
DODGE_FRACTION, LOG_DODGE = 0.2, 10**0.012


def draw(c: Comparisons, ax, title: str, unit: str = "characters") -> None:
  """Draws reward against response length on ``ax``, chosen and rejected responses apart.

  At one length the chosen responses sit a little left of it and the rejected ones a little
  right, so neither column hides the other.
  """
  lengths = c.responses[:, 1]
  log = _is_log_axis(lengths)
  for chosen, label, color, side in ((True, "chosen", "tab:green", -1), (False, "rejected", "tab:red", 1)):
    pts = c.responses[c.chosen_responses == chosen]
    ax.scatter(
      _dodged(pts[:, 1], side, lengths, log),
      pts[:, 0],
      s=8,
      alpha=0.5,
      color=color,
      label=f"{label} (n={len(pts)})",
    )
  _length_axis(ax, log)
  ax.set_xlabel(f"response length ({unit})")
  ax.set_ylabel("reward")
  ax.set_title(title)
  ax.legend()


def _is_log_axis(lengths: np.ndarray) -> bool:
  """Whether lengths float [R] span enough (more than :data:`LOG_SPAN` times) for a log axis."""
  return len(lengths) > 0 and lengths.max() > LOG_SPAN * max(lengths.min(), 1.0)


def _dodged(x: np.ndarray, side: int, lengths: np.ndarray, log: bool) -> np.ndarray:
  """Positions float [n] of lengths ``x`` moved a little to ``side`` (-1 left, 1 right)."""
  if log:  # a factor; the linear part of symlog (length 0) a fixed step
    return np.where(x >= 1, x * LOG_DODGE**side, x + side * 0.05)
  gaps = np.diff(np.unique(lengths))
  return x + side * DODGE_FRACTION * (gaps.min() if len(gaps) else 1.0)


def _length_axis(ax, log: bool) -> None:
  """Labels the x axis (response lengths, already plotted) at any range.

  Close lengths get a linear axis with whole-number ticks. Lengths that run from a few characters
  to thousands of tokens get a log scale; symlog keeps an empty response (length 0) on it. Its
  default ticks are the powers of ten alone, so the ticks are 1, 2 and 5 times each power of ten
  instead, and the axis reaches out to a tick on either side of the data.
  """
  from matplotlib import ticker

  if not log:
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    return
  ax.set_xscale("symlog", linthresh=1.0)  # lengths are whole numbers: linear between 0 and 1 only
  lo, hi = ax.get_xlim()  # the data's span, with matplotlib's margins
  ticks = length_ticks(hi)
  below = [t for t in ticks if t <= lo]
  ax.set_xlim(below[-1] if below else lo, ticks[-1])
  ax.xaxis.set_major_locator(ticker.FixedLocator(ticks))
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))


def length_ticks(longest: float) -> list[float]:
  """0, then 1, 2 and 5 times each power of ten, up to the first at or above ``longest``."""
  ticks, power = [0.0], 1.0
  while ticks[-1] < longest:
    for m in (1.0, 2.0, 5.0):
      if ticks[-1] < longest:
        ticks.append(m * power)
    power *= 10
  return ticks
