"""A tiny random causal LM over SmolLM2's vocabulary, loaded as a pairwise judge (the tests of
/compare and of evaluating judges)."""

import hf_tiny

from jaxrm import RewardModel


def tiny_judge(tokenizer, path) -> RewardModel:
  """A random 2-layer LlamaForCausalLM (tied embeddings) saved with ``tokenizer`` in ``path``,
  loaded as a judge with the default question and answers."""
  model = hf_tiny.build(
    "llama",
    head="causal",
    vocab_size=len(tokenizer),
    num_hidden_layers=2,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    tie_word_embeddings=True,
  )
  model.save_pretrained(path)
  tokenizer.save_pretrained(path)
  return RewardModel.from_pretrained(path, judge=True)
