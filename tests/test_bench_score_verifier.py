"""scripts/bench_score.py --verifier on a tiny causal LM: rm.score, the server and transformers'
causal LM score the same conversations, the two sides' log-odds are checked to agree, and the
results say they are a verifier's."""

import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_score  # noqa: E402

from jaxrm import RewardModel  # noqa: E402


def test_verifier_run_checks_transformers_and_is_marked(causal_dir, tmp_path, capsys):
  out = tmp_path / "score.json"
  bench_score.main(
    [
      f"--model={causal_dir}",
      "--verifier",
      "--items=4",
      "--batch_size=2",
      "--max_length=96",
      "--median_length=40",
      "--clients=2",
      "--items_per_request=2",
      "--repeats=1",
      f"--json={out}",
    ]
  )
  stdout = capsys.readouterr().out
  assert "LlamaForCausalLM" in stdout
  assert "logits of the last position" in stdout  # no full-vocabulary logits per token
  assert "jaxrm and transformers tokenize 4/4 identically" in stdout  # the texts are jaxrm's rows
  assert "max |jaxrm - transformers| log-odds (verifier) on a batch:" in stdout
  assert f"(at most {bench_score.AGREE_ATOL:g} in float32 on a CPU)" in stdout  # checked, not only shown
  assert "| scorer (verifier, zero-shot) |" in stdout
  with open(out) as f:
    report = json.load(f)
  assert report["args"]["verifier"] is True
  assert [r["name"] for r in report["results"]] == ["rm.score", "server", "transformers"]
  assert all(r["verifier"] is True and r["items_per_s"] > 0 for r in report["results"])


def test_scores_that_disagree_stop_the_run(causal_dir, capsys):
  rm = RewardModel.from_pretrained(causal_dir, verifier=True)
  hf = bench_score.Transformers(model=None, tokenizer=None, device="cpu", answers=(1, 2))
  args = bench_score.parse_args(["--verifier"])
  ours = np.array([0.5, -1.0], np.float32)
  bench_score.check_agreement(ours, ours + bench_score.AGREE_ATOL / 2, rm, hf, args)
  with pytest.raises(SystemExit, match="differ by 2.00e-03 > 0.001"):
    bench_score.check_agreement(ours, ours + 2 * bench_score.AGREE_ATOL, rm, hf, args)
  # bfloat16 rounds far more: shown, not checked.
  bench_score.check_agreement(
    ours, ours + 0.1, rm, hf, bench_score.parse_args(["--verifier", "--dtype=bfloat16"])
  )
  assert "not checked: bfloat16 or a GPU" in capsys.readouterr().out
