"""The figures an evaluation writes, read back from the matplotlib figure the same functions build."""

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxrm.benchmarks import length_bias
from jaxrm.evaluation import plot_scores


def drawn(draw):
  """The figure and axes that ``draw(ax)`` drew on, rendered (tick labels are set when drawn)."""
  fig = Figure()
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  draw(ax)
  fig.canvas.draw()
  return fig, ax


def labelled_ticks(ax) -> dict[float, str]:
  low, high = ax.get_xlim()
  return {
    t.get_position()[0]: t.get_text()
    for t in ax.get_xticklabels()
    if t.get_text() and low <= t.get_position()[0] <= high
  }


def short_comparisons():
  """Responses of 2 to 5 tokens, a chosen and a rejected one at each length."""
  pairs = [(1.0, 2, 0.5, 2), (0.2, 3, 0.4, 3), (0.9, 4, -0.3, 4), (0.1, 5, 0.6, 5), (0.3, 3, 0.2, 5)]
  responses = [r for c, lc, rj, lr in pairs for r in ((c, lc, True), (rj, lr, False))]
  return length_bias.comparisons(pairs, responses)


def test_length_bias_labels_every_length_of_short_responses():
  _, ax = drawn(lambda ax: length_bias.draw(short_comparisons(), ax, "short", unit="tokens"))
  assert ax.get_xscale() == "linear"  # a log axis over 2-5 labelled only 2 and 5
  assert labelled_ticks(ax) == {2.0: "2", 3.0: "3", 4.0: "4", 5.0: "5"}
  low, high = ax.get_xlim()
  assert low < 2 and high > 5  # every response is in view


def test_length_bias_keeps_chosen_and_rejected_of_one_length_apart():
  c = short_comparisons()
  _, ax = drawn(lambda ax: length_bias.draw(c, ax, "short"))
  chosen, rejected = (coll.get_offsets() for coll in ax.collections)
  assert [coll.get_label() for coll in ax.collections] == ["chosen (n=5)", "rejected (n=5)"]
  # Drawn 0.2 of the gap between lengths (1) either side of their length.
  np.testing.assert_allclose(chosen[:, 0], c.responses[c.chosen_responses, 1] - 0.2, rtol=0, atol=1e-12)
  np.testing.assert_allclose(rejected[:, 0], c.responses[~c.chosen_responses, 1] + 0.2, rtol=0, atol=1e-12)
  np.testing.assert_array_equal(chosen[:, 1], c.responses[c.chosen_responses, 0])


def test_length_bias_of_long_responses_is_log_with_labelled_ticks():
  lengths = [3, 40, 700, 2500]
  c = length_bias.comparisons(
    [(1.0, 3, 0.5, 40), (0.2, 700, 0.4, 2500)],
    [(1.0, 3, True), (0.5, 40, False), (0.2, 700, True), (0.4, 2500, False)],
  )
  _, ax = drawn(lambda ax: length_bias.draw(c, ax, "long"))
  assert ax.get_xscale() == "symlog"
  assert labelled_ticks(ax) == {x: f"{x:g}" for x in length_bias.length_ticks(2500) if x >= 2}
  low, high = ax.get_xlim()
  assert low <= min(lengths) and high >= max(lengths)
  chosen = ax.collections[0].get_offsets()[:, 0]
  np.testing.assert_allclose(chosen, np.array([3, 700]) / length_bias.LOG_DODGE, rtol=1e-12)


def regression_result():
  ratings = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 0.0], [4.0, 40.0]])
  rated = np.array([[True, True], [True, True], [True, False], [True, True]])
  return {
    "kind": "regression",
    "attributes": ["helpfulness", "verbosity"],
    "scores": {"ratings": ratings, "predictions": ratings * 0.9 + 0.1, "rated": rated},
  }


def test_regression_plot_has_one_panel_per_attribute_with_its_diagonal():
  result = regression_result()
  fig, _ = drawn(lambda ax: plot_scores(result, ax))
  panels = fig.axes
  assert [p.get_title() for p in panels] == ["helpfulness (n=4)", "verbosity (n=3)"]
  assert fig.get_suptitle() == "Predictions against ratings (dashed: prediction = rating)"
  for a, panel in enumerate(panels):
    rated = result["scores"]["rated"][:, a]
    points = panel.collections[0].get_offsets()
    np.testing.assert_array_equal(points[:, 0], result["scores"]["ratings"][rated, a])
    np.testing.assert_array_equal(points[:, 1], result["scores"]["predictions"][rated, a])
    (diagonal,) = panel.get_lines()
    assert list(diagonal.get_xdata()) == list(diagonal.get_ydata())  # y = x over the panel's points
    lo, hi = diagonal.get_xdata()
    assert lo <= points.min() and hi >= points.max()
    assert panel.get_legend() is None  # the title names the attribute: no legend over the points
    assert panel.get_xlabel() == "rating"
  assert [p.get_ylabel() for p in panels] == ["prediction", ""]


def test_regression_plot_needs_an_axes_of_a_grid():
  fig = Figure()
  with pytest.raises(ValueError, match=r"give an axes of a grid \(fig.add_subplot\(\) or plt.subplots\(\)\)"):
    plot_scores(regression_result(), fig.add_axes((0, 0, 1, 1)))


def test_written_rewards_png_is_wide_enough_for_the_panels(tmp_path):
  from PIL import Image

  from jaxrm.evaluation.report import write_outputs

  result = {**regression_result(), "metrics": {}, "subsets": {}}
  files = write_outputs(result, str(tmp_path), {})
  with Image.open(files[1]) as image:
    assert image.size == (700, 400)  # 7 x 4 inches at 100 dpi: two panels fit the default width
  result["attributes"] = ["a", "b", "c", "d", "e"]
  result["scores"] = {k: np.tile(v[:, :1], 5) for k, v in result["scores"].items()}
  with Image.open(write_outputs(result, str(tmp_path), {})[1]) as image:
    assert image.size == (1600, 400)  # 3.2 inches a panel
