"""jaxrm.serve answers the requests RL stacks already send to vLLM and SGLang, with the JSON those
servers answer. Each request below is the one the cited client sends, copied from its source; each
reward is checked against ``rm.score`` of the same text. Real requests on 127.0.0.1."""

import dataclasses
import math

import pytest
from helpers import OPENER, SERVER_CONFIG, SERVER_TEXTS, approx, assistant, call, metric, serving, user

from jaxrm import RewardModel
from jaxrm.scoring.loading import ScoringInfo

CONVERSATIONS = [
  [user("Capital of France?"), assistant("Paris")],
  [{"role": "system", "content": "Be brief."}, user("Capital of France?"), assistant("Lyon")],
]

MODEL = "/models/Skywork-Reward-V2"  # what a client names the model: echoed, never checked


@pytest.fixture(scope="module")
def url(tiny_rm):
  with serving(tiny_rm) as s:
    yield s.url


def sigmoid(x):
  return 1 / (1 + math.exp(-x))


def tokens(rm, texts):
  return sum(len(rm.tokenizer(t)["input_ids"]) for t in texts)


def usage(n):
  return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


# ------------------------------------------------------------------ vLLM /classify


def test_verl_reward_loop_vllm_classify(url, tiny_rm):
  # volcengine/verl, verl/experimental/reward_loop/reward_loop.py (compute_score_disrm, vllm engine):
  #   payloads = {"model": model_name, "input": disrm_prompt, "activation": False}
  #   output = await self._post_request(payloads, "classify")
  #   rm_score = output["data"][-1]["probs"][-1]
  disrm_prompt = SERVER_TEXTS[0]
  payloads = {"model": MODEL, "input": disrm_prompt, "activation": False}
  status, output, _ = call(url, "/classify", payloads)
  assert status == 200, output
  assert [output["data"][-1]["probs"][-1]] == approx(tiny_rm.score([disrm_prompt]))


def test_vllm_classification_client(url, tiny_rm):
  # vllm-project/vllm, examples/pooling/classify/openai_classification_client.py:
  #   payload = {"model": model_name, "input": prompts}; requests.post(".../classify", json=payload)
  # Answer: ClassificationResponse (vllm/entrypoints/pooling/classify/protocol.py): id "classify-...",
  # object "list", created, model, data[{index, label, probs, num_classes}], usage.
  prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
  ]
  for path in ("/classify", "/v1/classify"):
    status, reply, headers = call(url, path, {"model": MODEL, "input": prompts})
    assert status == 200, reply
    rewards = tiny_rm.score(prompts)
    assert reply["id"] == f"classify-{headers['X-Request-ID']}"
    assert (reply["object"], reply["model"], type(reply["created"])) == ("list", MODEL, int)
    assert [d["index"] for d in reply["data"]] == [0, 1, 2, 3]
    assert {(d["label"], d["num_classes"], len(d["probs"])) for d in reply["data"]} == {("LABEL_0", 1, 1)}
    # vLLM's activation for a one-label head without problem_type: sigmoid.
    assert [d["probs"][0] for d in reply["data"]] == approx([sigmoid(r) for r in rewards])
    assert reply["usage"] == usage(tokens(tiny_rm, prompts))
  # vLLM >= 0.11.2 names the switch use_activation (vllm/entrypoints/pooling/base/protocol.py,
  # ClassifyRequestMixin).
  status, reply, _ = call(url, "/classify", {"model": MODEL, "input": prompts, "use_activation": False})
  assert [d["probs"][0] for d in reply["data"]] == approx(tiny_rm.score(prompts))


def test_vllm_token_ids_and_truncation(url, tiny_rm):
  # input: list[int] | list[list[int]] | str | list[str] (PoolingCompletionRequest, CompletionRequestMixin).
  ids = [tiny_rm.tokenizer(t)["input_ids"] for t in SERVER_TEXTS]
  status, reply, _ = call(url, "/classify", {"input": ids[0], "use_activation": False})
  assert [d["probs"][0] for d in reply["data"]] == approx(tiny_rm.score_ids(ids[:1]))
  status, reply, _ = call(url, "/classify", {"input": ids, "use_activation": False})
  assert [d["probs"][0] for d in reply["data"]] == approx(tiny_rm.score_ids(ids))
  # truncate_prompt_tokens keeps the last tokens unless truncation_side says "right".
  status, reply, _ = call(
    url, "/classify", {"input": SERVER_TEXTS[0], "truncate_prompt_tokens": 5, "use_activation": False}
  )
  assert [d["probs"][0] for d in reply["data"]] == approx(tiny_rm.score_ids([ids[0][-5:]]))
  assert metric(url, "jaxrm_truncated") > 0  # the reward's health counts the rows cut
  status, reply, _ = call(
    url,
    "/classify",
    {
      "input": SERVER_TEXTS[0],
      "truncate_prompt_tokens": 5,
      "truncation_side": "right",
      "use_activation": False,
    },
  )
  assert [d["probs"][0] for d in reply["data"]] == approx(tiny_rm.score_ids([ids[0][:5]]))


# ------------------------------------------------------------------ vLLM /pooling


def test_vllm_sequence_reward_client(url, tiny_rm):
  # vllm-project/vllm, examples/pooling/reward/sequence_reward_online.py (and
  # examples/pooling/pooling/openai_pooling_client.py), both POST /pooling:
  #   prompt = {"model": model, "input": "vLLM is great!"}
  #   prompt = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "vLLM is great!"}]}]}
  # Answer: PoolingResponse (vllm/entrypoints/pooling/pooling/protocol.py): data[{index, object "pooling", data}].
  prompt = {"model": MODEL, "input": "vLLM is great!"}
  status, reply, headers = call(url, "/pooling", prompt)
  assert status == 200, reply
  assert reply["id"] == f"pool-{headers['X-Request-ID']}" and reply["object"] == "list"
  assert [d["data"] for d in reply["data"]] == [approx([sigmoid(tiny_rm.score(["vLLM is great!"])[0])])]
  assert reply["data"][0]["object"] == "pooling" and reply["usage"] == usage(
    tokens(tiny_rm, ["vLLM is great!"])
  )
  prompt = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "vLLM is great!"}]}],
    "use_activation": False,
  }
  status, reply, _ = call(url, "/pooling", prompt)
  assert status == 200, reply
  assert reply["data"][0]["data"] == approx(tiny_rm.score([[user("vLLM is great!")]]))
  # String contents, as a chat request also sends them, score alike.
  status, reply, _ = call(url, "/pooling", {"messages": CONVERSATIONS[0], "use_activation": False})
  assert reply["data"][0]["data"] == approx(tiny_rm.score(CONVERSATIONS[:1]))


# ------------------------------------------------------------------ vLLM /score


def test_vllm_cross_encoder_score_client(url, tiny_rm):
  # vllm-project/vllm, examples/pooling/score/openai_cross_encoder_score.py, POST /score:
  #   prompt = {"model": model_name, "text_1": text_1, "text_2": text_2}   (str/str, str/list, list/list)
  # A decoder without a separator token scores text_1 + text_2 as one text
  # (vllm/entrypoints/pooling/scoring/io_processor.py: full_prompt = prompt_1 + prompt_2).
  # Answer: ScoreResponse (vllm/entrypoints/pooling/scoring/protocol.py): data[{index, object "score", score}].
  cases = [
    ("What is the capital of Brazil?", "The capital of Brazil is Brasilia."),
    (
      "What is the capital of France?",
      ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
    ),
    (
      ["What is the capital of Brazil?", "What is the capital of France?"],
      ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
    ),
  ]
  for text_1, text_2 in cases:
    pairs = list(
      zip(
        text_1 if isinstance(text_1, list) else [text_1] * len(text_2),
        text_2 if isinstance(text_2, list) else [text_2],
      )
    )
    joined = [a + b for a, b in pairs]
    for path in ("/score", "/v1/score"):
      status, reply, headers = call(url, path, {"model": MODEL, "text_1": text_1, "text_2": text_2})
      assert status == 200, reply
      assert reply["id"] == f"score-{headers['X-Request-ID']}" and reply["model"] == MODEL
      assert [(d["index"], d["object"]) for d in reply["data"]] == [(i, "score") for i in range(len(pairs))]
      assert [d["score"] for d in reply["data"]] == approx([sigmoid(r) for r in tiny_rm.score(joined)])
      assert reply["usage"] == usage(tokens(tiny_rm, joined))


def test_vllm_queries_documents_score(url, tiny_rm):
  # Newer vLLM names the pair queries/documents (ScoreQueriesDocumentsRequest,
  # vllm/entrypoints/pooling/scoring/protocol.py); "use_activation": false gives the reward itself.
  body = {"model": MODEL, "queries": "Q: 1 + 1?", "documents": [" A: 2", " A: 3"], "use_activation": False}
  status, reply, _ = call(url, "/score", body)
  assert status == 200, reply
  assert [d["score"] for d in reply["data"]] == approx(tiny_rm.score(["Q: 1 + 1? A: 2", "Q: 1 + 1? A: 3"]))


def test_jaxrm_score_is_told_from_vllm_score(url, tiny_rm):
  # jaxrm's /score fields (conversations, prompts, completions) share no name with vLLM's.
  status, reply, _ = call(url, "/score", {"conversations": CONVERSATIONS})
  assert status == 200 and reply["rewards"] == approx(tiny_rm.score(CONVERSATIONS))
  status, reply, _ = call(
    url, "/score", {"prompts": ["a"], "completions": ["b"], "text_1": "a", "text_2": "b"}
  )
  assert status == 400 and "send jaxrm's score request or vLLM's" in reply["error"]
  status, reply, _ = call(url, "/v1/score", {"conversations": CONVERSATIONS})
  assert status == 400 and "pairs 'text_1' with 'text_2'" in reply["error"]


# ------------------------------------------------------------------ SGLang /classify


def test_sglang_reward_classify(url, tiny_rm):
  # sgl-project/sglang, docs/basic_usage/native_api.ipynb, "Classify (reward model)":
  #   prompts = tokenizer.apply_chat_template(CONVS, tokenize=False)
  #   data = {"model": "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2", "text": prompts}
  #   responses = requests.post(url, json=data).json()
  #   for response in responses: print_highlight(f"reward: {response['embedding'][0]}")
  # SGLang's /classify takes an EmbeddingReqInput (python/sglang/srt/managers/io_struct.py) and
  # answers {"embedding", "meta_info"} per item (python/sglang/srt/managers/tokenizer_manager.py).
  prompts = tiny_rm.tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False)
  data = {"model": "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2", "text": prompts}
  status, responses, headers = call(url, "/classify", data)
  assert status == 200, responses
  assert [response["embedding"][0] for response in responses] == approx(tiny_rm.score(prompts))
  rid = headers["X-Request-ID"]
  assert [r["meta_info"] for r in responses] == [
    {"id": f"{rid}-{i}", "prompt_tokens": tokens(tiny_rm, [p])} for i, p in enumerate(prompts)
  ]
  # One text (not a list): one object, not a list of them; the request's rid is its id.
  status, response, _ = call(url, "/classify", {"text": prompts[0], "rid": "r-1"})
  assert response["embedding"] == approx(tiny_rm.score(prompts[:1])) and response["meta_info"]["id"] == "r-1"
  ids = [tiny_rm.tokenizer(p)["input_ids"] for p in prompts]
  status, responses, _ = call(url, "/classify", {"input_ids": ids})
  assert [r["embedding"][0] for r in responses] == approx(tiny_rm.score_ids(ids))


def test_sglang_openai_embeddings(url, tiny_rm):
  # sgl-project/sglang, python/sglang/srt/entrypoints/openai/protocol.py: EmbeddingRequest {model,
  # input: str | list[str] | list[int] | list[list[int]]} -> EmbeddingResponse {data[{embedding,
  # index, object "embedding"}], model, object "list", usage}; a reward model's embedding is its score.
  status, reply, _ = call(url, "/v1/embeddings", {"model": MODEL, "input": SERVER_TEXTS})
  assert status == 200, reply
  assert (reply["object"], reply["model"]) == ("list", MODEL)
  assert [(d["object"], d["index"]) for d in reply["data"]] == [("embedding", i) for i in range(3)]
  assert [d["embedding"][-1] for d in reply["data"]] == approx(tiny_rm.score(SERVER_TEXTS))
  n = tokens(tiny_rm, SERVER_TEXTS)
  assert reply["usage"] == {"prompt_tokens": n, "total_tokens": n}
  ids = tiny_rm.tokenizer(SERVER_TEXTS[2])["input_ids"]
  status, reply, _ = call(url, "/v1/embeddings", {"input": ids})
  assert reply["data"][0]["embedding"] == approx(tiny_rm.score_ids([ids])) and reply["model"] == "tiny"


def test_openrlhf_get_reward_answers_as_its_serve_rm(url, tiny_rm):
  # OpenRLHF 0.11.2, openrlhf/utils/agent.py (SingleTurnAgentExecutor._fetch_rewards_via_http):
  # {"query", "prompts", "labels"}, labels null without --data.label_key; its serve_rm answers
  # {"rewards", "scores", "extra_logs"}. tests/test_rl_clients.py runs the executor itself.
  body = {"query": SERVER_TEXTS[:2], "prompts": ["What is 2 + 2?"] * 2, "labels": [None, None]}
  status, reply, _ = call(url, "/get_reward", body)
  assert status == 200, reply
  ids = [tiny_rm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in SERVER_TEXTS[:2]]
  assert reply["rewards"] == approx(tiny_rm.score_ids(ids)) and reply["scores"] == reply["rewards"]
  logs = reply["extra_logs"]
  assert {len(v) for v in logs.values()} == {2}  # a value per query, as OpenRLHF logs them
  assert logs["reward_health/reward_mean"][0] == metric(url, "jaxrm_reward_mean")
  assert logs["reward_health/reward_std"][0] == metric(url, "jaxrm_reward_std")
  # The tiny model's run recorded no reward range: no share outside it, in either place.
  assert "reward_health/reward_out_of_range" not in logs
  with OPENER.open(url + "/metrics") as reply:
    assert b"jaxrm_reward_out_of_range" not in reply.read()


# ------------------------------------------------------------------ what is refused, and why


@pytest.mark.parametrize(
  "path, body, message",
  [
    (
      "/classify",
      {"input": "a", "text": "a"},
      "the body has vLLM's 'input' and SGLang's 'text': send one format",
    ),
    ("/classify", {"prompt": "a"}, 'send vLLM\'s {"input": a text, a list of texts, or token ids}'),
    (
      "/classify",
      {"input": []},
      "'input' is a list; expected a text, a list of texts, or token ids (not empty)",
    ),
    ("/classify", {"input": [1, 10**9]}, "input[1] is 1000000000, not a token id of this model (0 to 49151)"),
    (
      "/classify",
      {"input": "a", "use_activation": "no"},
      "'use_activation' is a string; expected true, false or null",
    ),
    ("/classify", {"input": "a", "use_activation": True, "activation": False}, "disagree"),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens=0; expected a number"),
    ("/classify", {"input": ["a"] * 5}, "'input' has 5 items; this server scores at most 4 per request"),
    ("/classify", {"input": "one two " * 40}, "cannot score input: 81 tokens, longer than max_length=64"),
    ("/classify", {"text": [["query", "document"]]}, "text[0] is a list; expected a string"),
    ("/pooling", {"input": "a", "encoding_format": "base64"}, "this server answers floats"),
    (
      "/pooling",
      {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
      "messages[0].content[0] is not a text part",
    ),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "'text_1' has 2 texts and 'text_2' 3"),
    ("/score", {"text_1": "a"}, "the body lacks one of a pair"),
    (
      "/score",
      {"text_1": "a", "text_2": {"content": []}},
      "text_2[0] is an object; this server scores texts",
    ),
    ("/v1/classify", {"text": ["a"]}, "the body has neither 'input' nor 'messages'"),
    ("/v1/embeddings", {"text": "a"}, "the body has no 'input'; send {\"input\": a text"),
    ("/v1/embeddings", {"input": ["a"] * 5}, "'input' has 5 items; this server scores at most 4"),
    ("/reward", {"prompt": "a", "label": None}, "the body has no 'response'; send slime's"),
    ("/reward", {"prompt": "a", "response": ["b"]}, "'response' is a list; expected a string"),
    (
      "/reward",
      {"prompt": 7, "response": "b"},
      "'prompt' is an integer; expected a text or a list of messages",
    ),
    ("/reward", {"prompt": [], "response": "b"}, "prompts[0] has no messages"),
  ],
)
def test_malformed_format_requests_say_why(url, path, body, message):
  status, reply, _ = call(url, path, body)
  assert status in (400, 413), reply
  assert message in reply["error"]


# ------------------------------------------------------------------ a regression model


def test_regression_model_answers_its_output_as_vllm_does(tiny_rm):
  # An export of a regression model says problem_type "regression" (jaxrm/hf/export.py), for which
  # vLLM leaves the output as it is (get_classification_act_fn: PoolerIdentity); its label is the
  # attribute's name.
  rated = RewardModel(tiny_rm.model, tiny_rm.tokenizer, ScoringInfo(attributes=("helpfulness",)))
  with serving(rated, dataclasses.replace(SERVER_CONFIG, combine="helpfulness")) as s:
    status, reply, _ = call(s.url, "/classify", {"input": SERVER_TEXTS})
    assert status == 200, reply
    assert [d["probs"][0] for d in reply["data"]] == approx(tiny_rm.score(SERVER_TEXTS))
    assert {d["label"] for d in reply["data"]} == {"helpfulness"}
    status, reply, _ = call(s.url, "/classify", {"input": SERVER_TEXTS, "use_activation": True})
    assert [d["probs"][0] for d in reply["data"]] == approx([sigmoid(r) for r in tiny_rm.score(SERVER_TEXTS)])
