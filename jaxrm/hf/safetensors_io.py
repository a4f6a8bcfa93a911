"""Reading and writing Hugging Face checkpoint directories (config.json + safetensors).

Tensors are memory-mapped and read one at a time, so loading holds about one tensor on the host
beyond the model itself. bfloat16 is read through ml_dtypes (the safetensors numpy backend
cannot). Only safetensors is read: pickled ``pytorch_model.bin`` files are refused.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jaxrm.errors import CheckpointError

log = logging.getLogger(__name__)

_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """One memory-mapped .safetensors file."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    self.header: dict[str, Any] = header
    self._offset = 8 + n
    self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

  def keys(self) -> list[str]:
    return list(self.header)

  def get_tensor(self, key: str) -> np.ndarray:
    info = self.header[key]
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"{self.path}: tensor {key!r} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    raw = self._mmap[self._offset + start : self._offset + end]
    return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


class HFCheckpoint:
  """A transformers checkpoint directory: ``config`` (dict), ``keys()``, ``get_tensor(key)``."""

  def __init__(self, path: str):
    self.path = path
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
      raise CheckpointError(f"{path}: no config.json; expected a Hugging Face checkpoint directory")
    with open(cfg_path) as f:
      self.config: dict[str, Any] = json.load(f)
    self._files: dict[str, SafetensorsFile] = {}
    self._where: dict[str, str] | None = None  # key -> file; found on first use, after the config

  def _index(self) -> dict[str, str]:
    if self._where is not None:
      return self._where
    path = self.path
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    # transformers' precedence: model.safetensors, if there is one, before a sharded index.
    if os.path.isfile(single):
      if os.path.isfile(index):
        log.warning(
          "%s holds both model.safetensors and model.safetensors.index.json: reading "
          "model.safetensors, as transformers does; remove the index and its shards if they are stale",
          path,
        )
      self._where = {k: "model.safetensors" for k in self._file("model.safetensors").keys()}
    elif os.path.isfile(index):
      with open(index) as f:
        self._where = dict(json.load(f)["weight_map"])
    else:
      bins = [n for n in os.listdir(path) if n.endswith(".bin") or n.endswith(".pt")]
      if bins:
        raise CheckpointError(
          f"{path}: only pickled PyTorch weights ({', '.join(sorted(bins))}); jaxrm reads safetensors only. "
          "Convert once with transformers: AutoModel.from_pretrained(path).save_pretrained(path, "
          "safe_serialization=True)"
        )
      raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return self._where

  def _file(self, name: str) -> SafetensorsFile:
    if name not in self._files:
      self._files[name] = SafetensorsFile(os.path.join(self.path, name))
    return self._files[name]

  def keys(self) -> list[str]:
    return list(self._index())

  def get_tensor(self, key: str) -> np.ndarray:
    return self._file(self._index()[key]).get_tensor(key)


def save_safetensors(
  path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
  """Writes ``tensors`` (numpy, bfloat16 allowed) to one .safetensors file."""
  header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
  offset = 0
  for key, arr in tensors.items():
    nbytes = arr.nbytes
    header[key] = {
      "dtype": _NAMES[arr.dtype],
      "shape": list(arr.shape),
      "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in tensors.values():
      f.write(np.ascontiguousarray(arr).tobytes())
  os.replace(tmp, path)
