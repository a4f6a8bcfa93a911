"""An HF export (``RewardModel.save_pretrained``) holds what vLLM's and SGLang's loaders need to serve
it as a reward model.

These are checked against the requirements their code states -- each quoted below with its file in
vllm-project/vllm or sgl-project/sglang -- not by running vLLM or SGLang, which this suite does not
install. The pooled token is checked for real: transformers' model, made to pool the last token as
those servers do, scores like jaxrm.

* vLLM serves an architecture ending in ``ForSequenceClassification`` with the pooling runner and
  the classify converter (vllm/config/model.py, ``_SUFFIX_TO_DEFAULTS``), built from the family's
  registered ``*ForCausalLM`` by ``as_seq_cls_model`` (vllm/model_executor/models/adapters.py): a
  ``score`` head ``ReplicatedLinear(hidden_size, num_labels, bias=False)``, the hidden state of the
  last token pooled; ``classifier_from_token`` or ``method`` in the config would make it rebuild the
  head from ``lm_head`` instead. Its classify and score answers pass the head's output through
  ``get_classification_act_fn`` (vllm/model_executor/layers/pooler): ``problem_type="regression"``
  leaves it as it is, a one-label head without it gets a sigmoid.
* SGLang (``--is-embedding``) has ``LlamaForSequenceClassification`` (python/sglang/srt/models/
  llama_reward.py), ``Gemma2ForSequenceClassification`` (gemma2_reward.py),
  ``Qwen2ForSequenceClassification`` (qwen2_classification.py) and ``Qwen3ForSequenceClassification``
  (qwen3_classification.py): each a ``score`` Linear over ``config.num_labels`` after
  ``Pooler(PoolingType.LAST)``, weights named as transformers names them; Qwen3's pooler
  L2-normalizes unless the config has ``id2label``. It has no Mistral sequence classifier.
"""

import json
import struct

import hf_tiny
import numpy as np
import pytest
import torch
import transformers
from helpers import PARITY_ATOL

from jaxrm import RewardModel
from jaxrm.scoring.loading import ScoringInfo

ARCH = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2"}
SEQ_CLS = "ForSequenceClassification"
# Causal LMs vLLM registers, which as_seq_cls_model turns into the export's architecture.
VLLM_CAUSAL_LMS = {
  "LlamaForCausalLM",
  "MistralForCausalLM",
  "Qwen2ForCausalLM",
  "Qwen3ForCausalLM",
  "Gemma2ForCausalLM",
}
# SGLang's sequence classifiers, with whether their ``score`` Linear has a bias (nn.Linear's
# default, which the export -- like transformers' checkpoint -- has no tensor for).
SGLANG_SEQ_CLS = {
  "llama": ("LlamaForSequenceClassification", False),
  "gemma2": ("Gemma2ForSequenceClassification", False),
  "qwen2": ("Qwen2ForSequenceClassification", True),  # left at nn.Linear's random init
  "qwen3": ("Qwen3ForSequenceClassification", True),
}  # zeroed by its __init__


def safetensors_header(path) -> dict:
  """The tensors' names, dtypes and shapes, read from the file's JSON header."""
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


def export(tmp_path, family: str, *, num_labels: int | None = None, attributes=None):
  hf_tiny.build(family, "sequence", seed=5).save_pretrained(tmp_path / "src")
  rm = RewardModel.from_pretrained(tmp_path / "src", num_labels=num_labels)
  if attributes is not None:
    rm = RewardModel(rm.model, rm.tokenizer, ScoringInfo(attributes=attributes))
  rm.save_pretrained(tmp_path / "out")
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  header = safetensors_header(tmp_path / "out" / "model.safetensors")
  header.pop("__metadata__", None)
  return rm, config, header


# The families whose serving the requirements above are quoted for. Gemma 3's export
# (Gemma3TextForSequenceClassification) is not checked: the converter would look for a
# Gemma3TextForCausalLM, and vLLM's registry lists Gemma3ForCausalLM.
@pytest.mark.parametrize("family", tuple(ARCH))
def test_export_is_what_vllm_and_sglang_load_as_a_reward_model(family, tmp_path):
  _, config, header = export(tmp_path, family)
  (arch,) = config["architectures"]
  assert arch == ARCH[family] + SEQ_CLS
  assert arch.replace(SEQ_CLS, "ForCausalLM") in VLLM_CAUSAL_LMS  # vLLM converts it
  if family in SGLANG_SEQ_CLS:
    assert arch == SGLANG_SEQ_CLS[family][0]
  assert config["num_labels"] == 1
  assert header["score.weight"]["shape"] == [1, config["hidden_size"]]  # [num_labels, hidden]
  assert "score.bias" not in header  # vLLM's head has none; a tensor it has no place for fails its load
  assert all(k == "score.weight" or k.startswith("model.") for k in header), sorted(header)
  assert not {"classifier_from_token", "method"} & config.keys()  # else vLLM rebuilds the head from lm_head
  assert isinstance(config["pad_token_id"], int)  # transformers needs it to score a batch
  # No problem_type: vLLM's classify and score answer sigmoid(reward), the reward itself when asked
  # "use_activation": false (jaxrm's server does the same).
  assert config.get("problem_type") != "regression"
  # transformers gives a config without id2label one from num_labels: SGLang's Qwen3 pooler sees a
  # classification head and does not L2-normalize the reward.
  assert transformers.AutoConfig.from_pretrained(tmp_path / "out").id2label == {0: "LABEL_0"}


def test_regression_export_names_its_outputs(tmp_path):
  _, config, header = export(tmp_path, "qwen3", num_labels=2, attributes=("helpfulness", "verbosity"))
  # vLLM leaves a regression head's outputs as they are, and names them by id2label.
  assert config["problem_type"] == "regression"
  assert config["id2label"] == {"0": "helpfulness", "1": "verbosity"}
  assert config["label2id"] == {"helpfulness": 0, "verbosity": 1}
  assert (config["num_labels"], header["score.weight"]["shape"]) == (2, [2, config["hidden_size"]])


def test_the_pooled_token_is_the_last_one_as_vllm_and_sglang_pool_it(tmp_path):
  # vLLM and SGLang see each sequence unpadded and pool its last token. jaxrm pools the last token
  # its mask keeps, whatever the padding. transformers pools the last token that is not
  # pad_token_id: without a pad id (one row at a time) it pools the last token too, which is how
  # it stands in for them here.
  rm, config, _ = export(tmp_path, "llama")
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(
    tmp_path / "out", dtype=torch.float32, attn_implementation="eager"
  ).eval()
  pad = config["pad_token_id"]
  ids = np.array(
    [[5, 9, 33, 17, 41, pad]], np.int32
  )  # ends in the pad id, as a text ending in eos may when pad == eos
  ours = rm.score_tokens(ids, np.ones_like(ids))
  hf.config.pad_token_id = None
  last = hf_tiny.torch_forward(hf, ids.astype(np.int64), np.ones_like(ids, dtype=np.int64))[:, 0]
  np.testing.assert_allclose(ours, last, atol=PARITY_ATOL, rtol=0)
  padded = np.concatenate([ids, np.full((1, 3), pad, np.int32)], axis=1)  # padding is not pooled
  mask = np.array([[1] * ids.shape[1] + [0] * 3], np.int32)
  np.testing.assert_allclose(rm.score_tokens(padded, mask), ours, atol=PARITY_ATOL, rtol=0)
  # transformers with the export's pad id pools the token before a trailing pad id: an export whose
  # pad id is also its eos id scores texts ending in eos there differently from vLLM, SGLang and jaxrm.
  hf.config.pad_token_id = pad
  skipped = hf_tiny.torch_forward(hf, ids.astype(np.int64), np.ones_like(ids, dtype=np.int64))[:, 0]
  assert not np.allclose(skipped, ours, atol=PARITY_ATOL)


def test_export_carries_the_tokenizer_and_chat_template_the_servers_read(tiny_rm, tmp_path):
  # vLLM and SGLang tokenize with the checkpoint's own tokenizer, and render a chat request
  # (vLLM's "messages") with its chat template.
  tiny_rm.save_pretrained(tmp_path / "out")
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  assert tokenizer.chat_template == tiny_rm.tokenizer.chat_template and tokenizer.chat_template
  text = "<|im_start|>user\nhi<|im_end|>\n"
  assert tokenizer(text)["input_ids"] == tiny_rm.tokenizer(text)["input_ids"]
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["pad_token_id"] == tokenizer.pad_token_id
