"""POST /compare: a pairwise judge's group rewards and log-odds over HTTP, equal to
``rm.score_groups``; a judge refused on the one-reward routes and a reward model on
/compare, each naming what to use; a bad group refused by field."""

import dataclasses
import urllib.request

import pytest
from helpers import SERVER_CONFIG, approx, call, serving, user

from jaxrm import RewardModel, tasks
from jaxrm.errors import ConfigError
from jaxrm.server.app import ENDPOINTS, check_model
from jaxrm.server.bodies import Encoder, RequestError
from jaxrm.server.formats import ROUTES

PROMPT = [user("What is 2 + 2?")]
RESPONSES = ["4", "It is 5.", "Four."]
# A judge text here is about 100 tokens (SmolLM2's template, the judge's layout and question).
CONFIG = dataclasses.replace(SERVER_CONFIG, max_batch=8, max_length=128, buckets=(128,))


@pytest.fixture(scope="module")
def judge(causal_dir):
  return RewardModel.from_pretrained(causal_dir, judge=True)


@pytest.fixture(scope="module")
def server(judge):
  with serving(judge, CONFIG) as s:
    yield s


def _flat(matrix):
  return [x for row in matrix for x in row if x is not None]


def _nulls(matrix):
  return [(i, j) for i, row in enumerate(matrix) for j, x in enumerate(row) if x is None]


@pytest.mark.parametrize(
  "body, groups",
  [
    ({"prompt": PROMPT, "responses": RESPONSES}, {}),
    (
      {"prompt": "What is 2 + 2?", "responses": RESPONSES[:2], "aggregate": "win_rate"},
      {"aggregate": "win_rate"},
    ),
    (
      {"prompt": PROMPT, "responses": RESPONSES, "strategy": "reference", "reference": "4, since 2 + 2 = 4."},
      {"strategy": "reference", "references": ["4, since 2 + 2 = 4."]},
    ),
  ],
  ids=["round_robin", "win_rate", "reference"],
)
def test_compare_answers_score_groups(judge, server, body, groups):
  (want,) = judge.score_groups([body["prompt"]], [body["responses"]], **groups)
  want = want.to_json()
  status, reply, _ = call(server.url, "/compare", body)
  assert status == 200, reply
  assert reply["rewards"] == approx(want["rewards"])
  assert _nulls(reply["log_odds"]) == _nulls(want["log_odds"])
  assert _flat(reply["log_odds"]) == approx(_flat(want["log_odds"]))


def test_metrics_count_the_responses_ranked_and_their_judge_texts(server):
  before = _counts(server.url)
  status, reply, _ = call(server.url, "/compare", {"prompt": PROMPT, "responses": RESPONSES})
  assert status == 200, reply
  after = _counts(server.url)
  assert [b - a for a, b in zip(before, after)] == [3, 6]  # round robin: 3 * 2 ordered pairs


def _counts(url) -> list[float]:
  """(responses ranked, judge texts scored) as /metrics counts them."""
  with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
    lines = reply.read().decode().splitlines()
  names = ("jaxrm_compared_responses_total ", "jaxrm_judge_texts_total ")
  return [float(next(line for line in lines if line.startswith(n)).split()[-1]) for n in names]


@pytest.mark.parametrize(
  "path, body",
  [
    ("/score", {"prompts": ["Hi"], "completions": ["Hello"]}),
    ("/v1/score", {"text_1": "Hi", "text_2": "Hello"}),
    ("/reward", {"prompt": "Hi", "response": "Hello"}),
  ],
)
def test_one_reward_routes_refuse_a_judge_naming_compare(server, path, body):
  status, reply, _ = call(server.url, path, body)
  assert status == 400 and reply["error"].startswith(
    f"{path} gives one reward per item, and this server's model is a pairwise judge, which "
    'compares responses: POST /compare with {"prompt"'
  ), reply


@pytest.mark.parametrize(
  "body, message",
  [
    (
      {"prompt": PROMPT, "responses": ["4"]},
      "'responses': a group of 1 response: strategy='round_robin' compares responses with each "
      "other, so it needs at least 2",
    ),
    (
      {"prompt": PROMPT, "responses": RESPONSES, "strategy": "best_of"},
      "'strategy' is 'best_of'; expected one of round_robin, circular, reference",
    ),
    (
      {"prompt": PROMPT, "responses": RESPONSES, "aggregate": 3},
      "'aggregate' is an integer; expected one of bradley_terry, win_rate",
    ),
    (
      {"prompt": PROMPT, "responses": RESPONSES, "strategy": "reference"},
      "strategy 'reference' compares each response with 'reference', and the body has none: send it",
    ),
    (
      {"prompt": PROMPT, "responses": RESPONSES, "reference": "4"},
      "'reference' is compared with only under \"strategy\": \"reference\"; this body asks for 'round_robin'",
    ),
    (
      {"prompt": PROMPT, "responses": ["a", "b", "c", "d"]},
      "'responses' has 4 responses, which strategy 'round_robin' compares in 12 judge texts; this "
      "server scores at most 8 per request (--max_batch): send at most 3 responses, or strategy "
      "'circular' (2 judge texts per response)",
    ),
    (
      {"prompt": PROMPT, "responses": ["a"] * 5, "strategy": "circular"},
      "'responses' has 5 responses, which strategy 'circular' compares in 10 judge texts; this "
      "server scores at most 8 per request (--max_batch): send at most 4 responses",
    ),
    ({"responses": RESPONSES}, "the body has no 'prompt'; send " + '{"prompt": a text or messages'),
  ],
  ids=[
    "one",
    "strategy",
    "aggregate",
    "no_reference",
    "reference_unasked",
    "round_robin_over",
    "circular_over",
    "no_prompt",
  ],
)
def test_bad_groups_are_refused_by_field(server, body, message):
  status, reply, _ = call(server.url, "/compare", body)
  assert status == 400 and reply["error"].startswith(message), reply


def test_a_reward_model_on_compare_is_told_to_score(model_dir):
  rm = RewardModel.from_pretrained(model_dir)
  with pytest.raises(RequestError) as e:
    ROUTES["/compare"](Encoder(rm, CONFIG), {"prompt": PROMPT, "responses": RESPONSES})
  assert e.value.status == 400 and str(e.value) == (
    "/compare ranks responses with a pairwise judge; this server's model has a sequence head with "
    "1 output (preference), which scores each response alone: POST /score with 'prompts' and "
    "'completions'"
  )


def test_the_server_serves_each_tasks_routes_after_its_own():
  """A task's routes come from its spec (Task.routes): the server lists them after its own."""
  added = [path for task in tasks.TASKS.values() for path in task.routes]
  assert "/compare" in added and list(ROUTES)[-len(added) :] == added
  assert ENDPOINTS.endswith(", ".join(f"POST {path}" for path in added))


def test_each_task_giving_no_reward_per_row_names_the_route_to_use_instead():
  for task in tasks.TASKS.values():
    assert (task.route_instead is not None) == (task.scores == "comparisons"), task.name


@pytest.mark.parametrize("setting", [{"combine": "mean"}, {"normalize": True}])
def test_a_judge_served_with_combine_or_normalize_is_told_what_it_is(judge, setting):
  """--combine and --normalize shape one reward per response; a judge's rewards come from its
  comparisons, and the refusal says what it is and which route to use (its task's words)."""
  with pytest.raises(ConfigError) as e:
    check_model(judge, dataclasses.replace(CONFIG, **setting))
  assert str(e.value).startswith(
    f"--{next(iter(setting))} applies to rewards scored one per response, and this server's model is "
    'a pairwise judge, which compares responses: POST /compare with {"prompt"'
  ), str(e.value)
