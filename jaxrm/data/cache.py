"""Tokenized examples kept on disk, so that a run tokenizes its data once, in parallel.

:func:`load_tokenized` reads records, tokenizes them in ``num_proc`` processes and writes the
examples, with the rows dropped on the way, into a cache directory named by a hash of everything
that changes them (:func:`cache_key`): the source's content, the dataset name and options, the
tokenizer files and chat template, every :class:`~jaxrm.data.tokenize.TokenizeOptions` field,
:data:`TOKENIZE_VERSION` and the installed versions of jaxrm, transformers and tokenizers
(:func:`installed_versions`). A later start with the same inputs opens that directory instead: the
examples are memory-mapped and built on access, so neither the records nor the examples are all
held in memory.

Layout of one entry, ``<cache_dir>/<key hash>/``: ``manifest.json`` (the key, the example type,
each field's kind and dtype, the drop report, and each data file's size and xxh3-128 checksum), per
field raw little-endian arrays (``<field>.values.bin``; ``<field>.lengths.bin``, one length per
example, for ragged fields; ``<field>.inner.bin`` for tuples of arrays; ``<field>.null.bin`` for
optional numbers), and ``checksum.json``, the manifest's own size and checksum, written last.
Fields are stored by their dataclass type, so a new example type needs no change here. An entry is
written into a temporary directory and renamed into place, so processes sharing a cache directory
never see a partial one; a lock file makes a second process wait for the first one's entry rather
than tokenize the same data again. Every file of an entry is checked against its checksum before
the entry is used: a damaged one (truncated, edited, a file missing or added) is never read, but
named in a warning and rebuilt from the source.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import importlib.metadata
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import sys
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxrm.data.drops import DropReport
from jaxrm.data.sources import file_fingerprint
from jaxrm.data.tokenize import TokenizeOptions, tokenize_all

log = logging.getLogger(__name__)

# Bump when tokenize.py, or a parser feeding it (formats.py, adapters.py), changes what a row
# becomes: entries written under another version are never read. A release changes the key by
# itself (installed_versions); this number covers changes between releases.
TOKENIZE_VERSION = 1
VERSIONED_PACKAGES = ("jaxrm", "transformers", "tokenizers")
CACHE_FORMAT = 2  # 2: checksums
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "jaxrm", "tokenized")
CHUNK_SIZE = 1000  # records per task sent to a worker process
MANIFEST = "manifest.json"
CHECKSUM = "checksum.json"  # the manifest's size and checksum; written last

Records = Iterable[Any]  # PreferenceRecord | StepwiseRecord | ...


# ------------------------------------------------------------------ the key


def cache_key(source: dict[str, Any], tokenizer, options: TokenizeOptions) -> dict[str, Any]:
  """Everything that changes the tokenized examples, as a JSON-able dict.

  Args:
    source: where the records come from and how they are read: dataset name, split, read
      options, a row limit and the source's fingerprint (:func:`jaxrm.data.sources.fingerprint`).
    tokenizer: a Hugging Face tokenizer.
    options: how records are tokenized.
  """
  return {
    "tokenize_version": TOKENIZE_VERSION,
    "cache_format": CACHE_FORMAT,
    "versions": installed_versions(),
    "source": source,
    "tokenizer": tokenizer_fingerprint(tokenizer),
    "options": dataclasses.asdict(options),
  }


def installed_versions() -> dict[str, str | None]:
  """The installed version of each of :data:`VERSIONED_PACKAGES` (None: not installed), so that
  an upgrade of jaxrm or of the tokenizing packages never reads an entry the old one wrote."""
  versions = {}
  for name in VERSIONED_PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def key_hash(key: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
  """A hash of what decides a tokenizer's ids: its backend (vocabulary, merges, normalizer,
  pre- and post-processor), special tokens, BOS/EOS settings and chat template."""
  h = hashlib.sha256()
  backend = getattr(tokenizer, "backend_tokenizer", None)
  if backend is not None:
    h.update(backend.to_str().encode("utf-8"))
  else:  # a slow tokenizer: its vocabulary and settings
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    h.update(json.dumps(getattr(tokenizer, "init_kwargs", {}), sort_keys=True, default=str).encode("utf-8"))
  settings = {
    "class": type(tokenizer).__name__,
    "chat_template": getattr(tokenizer, "chat_template", None),
    "special_tokens": {k: str(v) for k, v in getattr(tokenizer, "special_tokens_map", {}).items()},
    "add_bos_token": getattr(tokenizer, "add_bos_token", None),
    "add_eos_token": getattr(tokenizer, "add_eos_token", None),
  }
  h.update(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))
  return h.hexdigest()


# ------------------------------------------------------------------ loading


def load_tokenized(
  read_records: Callable[[DropReport], Records],
  *,
  tokenizer,
  options: TokenizeOptions,
  drops: DropReport,
  source: dict[str, Any] | None = None,
  cache_dir: str | None = None,
  num_proc: int = 1,
  chunk_size: int = CHUNK_SIZE,
) -> Sequence:
  """The tokenized examples of ``read_records(drops)``, from the cache when it has them.

  Args:
    read_records: reads the records, counting rows dropped while parsing in the report it is
      given; called only on a cache miss. A generator keeps memory flat.
    tokenizer: a Hugging Face tokenizer.
    options: how records are tokenized.
    drops: where dropped rows are counted (parsing and tokenization; a cache hit counts them as
      the first start did).
    source: what the records are (see :func:`cache_key`); None: nothing is cached (a set made on
      the spot).
    cache_dir: where entries live; None: nothing is cached.
    num_proc: tokenizer processes; 1 tokenizes in this process. The examples and drop counts are
      the same for every value.
    chunk_size: records per task of a process.

  Returns:
    The examples in record order: a :class:`CachedExamples` when cached, else a list.
  """
  if source is None or cache_dir is None:
    return _tokenize_to_list(read_records, tokenizer, options, drops, num_proc, chunk_size)
  key = cache_key(source, tokenizer, options)
  root = os.path.expanduser(cache_dir)
  entry = os.path.join(root, key_hash(key))
  os.makedirs(root, exist_ok=True)
  with _lock(entry + ".lock"):
    damage = damaged(entry) if os.path.lexists(entry) else None
    if damage is not None:
      log.warning(
        "the tokenized cache entry %s is damaged (%s): not used, rebuilt from the source", entry, damage
      )
      _discard(entry)
    if not os.path.lexists(entry):
      log.info("tokenizing into the cache: %s", entry)
      _build(entry, key, read_records, tokenizer, options, num_proc, chunk_size)
    else:
      log.info("tokenized examples from the cache: %s", entry)
  examples = CachedExamples(entry)
  drops.merge(examples.drops)
  return examples


def _tokenize_to_list(read_records, tokenizer, options, drops, num_proc, chunk_size) -> list:
  out = []
  for examples, chunk_drops in _tokenized_chunks(
    read_records(drops), tokenizer, options, num_proc, chunk_size
  ):
    out.extend(examples)
    drops.merge(chunk_drops)
  return out


@contextlib.contextmanager
def _lock(path: str):
  """An exclusive lock on ``path`` (a file beside the entry) while the entry is looked up or built."""
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


# ------------------------------------------------------------------ file hashes

HASHES = "-file_hashes"  # <cache_dir>-file_hashes/<hash of the file's real path>.json


def file_hash(path: str, cache_dir: str | None) -> dict[str, Any]:
  """``{"size", "mtime_ns", "xxh3_128"}`` of the file at ``path``: its size and modification time,
  and a hash of its content, computed once for a size, time and inode and kept beside
  ``cache_dir``, the tokenized entries' folder (in ``<cache_dir>-file_hashes``; None: computed each
  time).

  Raises:
    OSError: the file cannot be read.
  """
  stat = os.stat(path)
  known = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
  record = None
  if cache_dir is not None:
    real = os.path.realpath(path)
    name = hashlib.sha256(real.encode("utf-8")).hexdigest()[:32] + ".json"
    record = os.path.join(os.path.expanduser(cache_dir).rstrip(os.sep) + HASHES, name)
    try:
      with open(record) as f:
        kept = json.load(f)
      if isinstance(kept, dict) and kept.get("path") == real and {**kept, **known} == kept:
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "xxh3_128": kept["xxh3_128"]}
    except (OSError, ValueError, KeyError):
      pass  # not hashed yet, or by another file at this path: hashed again
  digest = file_fingerprint(path)["xxh3_128"]
  if record is not None:
    _write_json_atomically(record, {"path": real, **known, "xxh3_128": digest})
  return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "xxh3_128": digest}


def _write_json_atomically(path: str, value: Any) -> None:
  """Writes ``value`` where ``path`` is, or nothing where the folder cannot be written (the hash
  is computed again next time)."""
  tmp = f"{path}.{uuid.uuid4().hex}.tmp"
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "w") as f:
      json.dump(value, f)
    os.replace(tmp, path)
  except OSError as e:
    log.info("the hash of a file is not kept (%s): it is computed again at the next start", e)
    with contextlib.suppress(OSError):
      os.remove(tmp)


# ------------------------------------------------------------------ tokenizing in chunks


def _tokenized_chunks(
  records: Records, tokenizer, options: TokenizeOptions, num_proc: int, chunk_size: int
) -> Iterator[tuple[list, DropReport]]:
  """``(examples, drops)`` per chunk of ``chunk_size`` records, in record order."""
  chunks = _chunked(records, chunk_size)
  if num_proc <= 1:
    for chunk in chunks:
      yield _tokenize_chunk(chunk, tokenizer, options)
    return
  # spawn: the parent may hold JAX's threads, which a forked child would inherit half-started.
  context = multiprocessing.get_context("spawn")
  with _main_module_hidden():  # every worker starts here, in the constructor
    pool = context.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer, options))
  try:
    # At most two chunks per process in flight: records are read only as fast as they are used.
    pending = collections.deque()
    for chunk in chunks:
      pending.append(pool.apply_async(_worker_chunk, (chunk,)))
      if len(pending) >= 2 * num_proc:
        yield pending.popleft().get()
    while pending:
      yield pending.popleft().get()
    pool.close()
  finally:
    pool.terminate()
    pool.join()


@contextlib.contextmanager
def _main_module_hidden():
  """Hides ``__main__`` from the spawned workers, which need nothing from it: spawn would run a
  main script again in each of them, and one without an ``if __name__ == "__main__":`` guard
  would start its own training there."""
  main = sys.modules["__main__"]
  saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
  main.__dict__.pop("__file__", None)
  main.__spec__ = None
  try:
    yield
  finally:
    main.__dict__.update(saved)


def _chunked(records: Records, size: int) -> Iterator[list]:
  it = iter(records)
  while chunk := list(itertools.islice(it, size)):
    yield chunk


def _tokenize_chunk(records: list, tokenizer, options: TokenizeOptions) -> tuple[list, DropReport]:
  drops = DropReport()
  return tokenize_all(records, tokenizer, options, drops), drops


_worker: dict[str, Any] = {}


def _init_worker(tokenizer, options: TokenizeOptions) -> None:
  os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
  _worker.update(tokenizer=tokenizer, options=options)


def _worker_chunk(records: list) -> tuple[list, DropReport]:
  return _tokenize_chunk(records, _worker["tokenizer"], _worker["options"])


# ------------------------------------------------------------------ field kinds


def _kind(annotation) -> str:
  """How a field of this type is stored: array | arrays | ints | floats | int | float | bool |
  str | json (anything else JSON can hold); ``?`` after a number kind: it may be None."""
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if annotation is np.ndarray:
    return "array"
  if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
    inner = _kind(next(a for a in args if a is not type(None)))
    return f"{inner}?" if inner in ("int", "float", "bool") else "json"
  if annotation in (int, float, bool, str):
    return annotation.__name__
  if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
    return {np.ndarray: "arrays", int: "ints", float: "floats"}.get(args[0], "json")
  return "json"


def _field_kinds(example_type) -> dict[str, str]:
  hints = typing.get_type_hints(example_type)
  return {f.name: _kind(hints[f.name]) for f in dataclasses.fields(example_type)}


def _type_name(example_type) -> str:
  return f"{example_type.__module__}:{example_type.__qualname__}"


def _example_type(name: str):
  module, _, qualname = name.partition(":")
  if not module.startswith("jaxrm."):
    raise ValueError(f"cached example type {name!r} is not a jaxrm type")
  return getattr(importlib.import_module(module), qualname)


def _columns(examples: list, kinds: dict[str, str]) -> dict[str, dict[str, np.ndarray]]:
  """Each field's streams (values, lengths, inner, null) for a chunk of examples."""
  out = {}
  for name, kind in kinds.items():
    values = [getattr(e, name) for e in examples]
    out[name] = _encode(kind, values, name, examples)
  return out


def _encode(kind: str, values: list, name: str, examples: list) -> dict[str, np.ndarray]:
  if kind == "array":
    return {
      "values": np.concatenate(values) if values else np.zeros(0, np.int32),
      "lengths": np.array([len(v) for v in values], np.int64),
    }
  if kind == "arrays":
    flat = [a for v in values for a in v]
    return {
      "values": np.concatenate(flat) if flat else np.zeros(0, np.int32),
      "lengths": np.array([len(v) for v in values], np.int64),
      "inner": np.array([len(a) for a in flat], np.int64),
    }
  if kind in ("ints", "floats"):
    dtype = np.int64 if kind == "ints" else np.float64
    return {
      "values": np.array([x for v in values for x in v], dtype),
      "lengths": np.array([len(v) for v in values], np.int64),
    }
  if kind.rstrip("?") in ("int", "float", "bool"):
    dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_}[kind.rstrip("?")]
    null = np.array([v is None for v in values], np.bool_)
    stream = {"values": np.array([0 if v is None else v for v in values], dtype)}
    return {**stream, "null": null} if kind.endswith("?") else stream
  if kind == "str":
    texts = [v.encode("utf-8") for v in values]
  else:
    texts = [_json_text(v, name, e) for v, e in zip(values, examples)]
  return {
    "values": np.frombuffer(b"".join(texts), np.uint8),
    "lengths": np.array([len(t) for t in texts], np.int64),
  }


def _json_text(value, name: str, example) -> bytes:
  text = json.dumps(value, sort_keys=True)
  if json.loads(text) != value:
    raise ValueError(
      f"{example.source}: field {name!r} = {value!r} does not survive JSON (tuples, non-string "
      "keys...); cached fields hold arrays, numbers, strings and JSON values"
    )
  return text.encode("utf-8")


# ------------------------------------------------------------------ writing an entry


def _build(entry: str, key: dict, read_records, tokenizer, options, num_proc: int, chunk_size: int) -> None:
  """Tokenizes into ``<entry>.tmp-*`` and renames it to ``entry`` once complete."""
  tmp = f"{entry}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  os.makedirs(tmp)
  try:
    drops = DropReport()
    writer = _Writer(tmp)
    for examples, chunk_drops in _tokenized_chunks(
      read_records(drops), tokenizer, options, num_proc, chunk_size
    ):
      writer.add(examples)
      drops.merge(chunk_drops)
    writer.finish(key, drops)
    try:
      os.rename(tmp, entry)
    except OSError:  # another process (without the lock: another host) wrote it first
      if damaged(entry) is not None:
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


class _Writer:
  """Appends each chunk's streams to their files."""

  def __init__(self, directory: str):
    self.directory = directory
    self.example_type = None
    self.kinds: dict[str, str] = {}
    self.dtypes: dict[str, str] = {}
    self.count = 0
    self.files: dict[str, Any] = {}

  def add(self, examples: list) -> None:
    if not examples:
      return
    if self.example_type is None:
      self.example_type = type(examples[0])
      self.kinds = _field_kinds(self.example_type)
    mixed = next((e for e in examples if type(e) is not self.example_type), None)
    if mixed is not None:
      raise ValueError(
        f"{mixed.source}: a {type(mixed).__name__} among {self.example_type.__name__}s; a data "
        "set holds one kind of example"
      )
    for name, streams in _columns(examples, self.kinds).items():
      for stream, array in streams.items():
        self._write(name, stream, array, examples)
    self.count += len(examples)

  def _write(self, name: str, stream: str, array: np.ndarray, examples: list) -> None:
    if stream == "values":
      dtype = self.dtypes.setdefault(name, array.dtype.str)
      if array.size and array.dtype.str != dtype:
        raise ValueError(
          f"{examples[0].source}: field {name!r} holds {array.dtype} where earlier examples "
          f"hold {np.dtype(dtype)}; every example must use one dtype"
        )
      array = array.astype(dtype, copy=False)
    path = os.path.join(self.directory, f"{name}.{stream}.bin")
    if path not in self.files:
      self.files[path] = open(path, "wb")
    self.files[path].write(np.ascontiguousarray(array).tobytes())

  def finish(self, key: dict, drops: DropReport) -> None:
    for f in self.files.values():
      f.close()
    manifest = {
      "key": key,
      "num_examples": self.count,
      "drops": _drops_to_dict(drops),
      "example_type": None if self.example_type is None else _type_name(self.example_type),
      "fields": {n: {"kind": k, "dtype": self.dtypes.get(n)} for n, k in self.kinds.items()},
      "files": {os.path.basename(p): file_fingerprint(p) for p in sorted(self.files)},
    }
    with open(os.path.join(self.directory, MANIFEST), "w") as f:
      json.dump(manifest, f)
    with open(os.path.join(self.directory, CHECKSUM), "w") as f:
      json.dump(file_fingerprint(os.path.join(self.directory, MANIFEST)), f)


def _drops_to_dict(drops: DropReport) -> dict:
  return {"counts": dict(drops.counts), "examples": {r: list(v) for r, v in drops.examples.items()}}


def _drops_from_dict(d: dict) -> DropReport:
  drops = DropReport()
  drops.counts.update(d["counts"])
  for reason, sources in d["examples"].items():
    drops.examples[reason].extend(sources)
  return drops


# ------------------------------------------------------------------ checking an entry


def damaged(entry: str) -> str | None:
  """What is wrong with the cache entry ``entry``, naming the file; None when every file of it
  matches the checksum written with it."""
  if not os.path.isdir(entry):
    return f"{entry} is not a directory"
  try:
    with open(os.path.join(entry, CHECKSUM)) as f:
      want = json.load(f)
  except (OSError, ValueError):
    return f"{CHECKSUM} is missing or unreadable"
  manifest_path = os.path.join(entry, MANIFEST)
  if not os.path.isfile(manifest_path) or file_fingerprint(manifest_path) != want:
    return f"{MANIFEST} does not match {CHECKSUM}"
  with open(manifest_path) as f:
    files = json.load(f)["files"]
  extra = sorted(set(os.listdir(entry)) - set(files) - {MANIFEST, CHECKSUM})
  if extra:
    return f"{', '.join(extra)}: not written with the entry"
  for name, fingerprint in files.items():
    path = os.path.join(entry, name)
    if not os.path.isfile(path):
      return f"{name} is missing"
    got = file_fingerprint(path)
    if got["size"] != fingerprint["size"]:
      return f"{name} holds {got['size']} bytes, written with {fingerprint['size']}"
    if got != fingerprint:
      return f"{name} does not match its checksum"
  return None


def _discard(entry: str) -> None:
  """Removes a damaged entry; renamed first, so that no process sees it half removed."""
  doomed = f"{entry}.damaged-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  os.rename(entry, doomed)
  if os.path.isdir(doomed):
    shutil.rmtree(doomed, ignore_errors=True)
  else:
    os.remove(doomed)


# ------------------------------------------------------------------ reading an entry


class CachedExamples(Sequence):
  """The examples of one cache entry, memory-mapped and built when indexed.

  Arrays are read-only views of the cache files. Pickling (grain's worker processes) sends the
  entry's path, not its data.
  """

  def __init__(self, entry: str):
    self.entry = entry
    with open(os.path.join(entry, MANIFEST)) as f:
      manifest = json.load(f)
    self.key = manifest["key"]
    self.drops = _drops_from_dict(manifest["drops"])
    self._n = manifest["num_examples"]
    self.example_type = _example_type(manifest["example_type"]) if manifest["example_type"] else None
    files = set(manifest["files"])
    self._fields = {
      name: _Column(entry, name, spec["kind"], spec["dtype"], files)
      for name, spec in manifest["fields"].items()
    }

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self[i] for i in range(*index.indices(self._n))]
    if not -self._n <= index < self._n:
      raise IndexError(f"example {index} of {self._n}")
    index %= self._n
    return self.example_type(**{name: column[index] for name, column in self._fields.items()})

  def __reduce__(self):
    return CachedExamples, (self.entry,)

  def num_tokens(self, field: str = "input_ids") -> int:
    """Tokens of every example in ``field``, without building them."""
    return int(self._fields[field].values.size)


class _Column:
  """One field's streams, mapped from its files."""

  def __init__(self, entry: str, name: str, kind: str, dtype: str | None, files: set[str]):
    self.kind = kind

    def path(stream: str) -> str | None:  # None: the entry was written without this stream
      return os.path.join(entry, f"{name}.{stream}.bin") if f"{name}.{stream}.bin" in files else None

    self.values = _map(path("values"), dtype or "<i4")
    self.offsets = _offsets(path("lengths"))
    self.inner = _offsets(path("inner"))
    null = path("null")
    self.null = None if null is None else _map(null, "|b1")

  def __getitem__(self, i: int):
    kind = self.kind
    if kind == "array":
      return self.values[self.offsets[i] : self.offsets[i + 1]]
    if kind == "arrays":
      inner = self.inner
      return tuple(self.values[inner[j] : inner[j + 1]] for j in range(self.offsets[i], self.offsets[i + 1]))
    if kind in ("ints", "floats"):
      return tuple(self.values[self.offsets[i] : self.offsets[i + 1]].tolist())
    if kind.rstrip("?") in ("int", "float", "bool"):
      return None if self.null is not None and self.null[i] else self.values[i].item()
    raw = self.values[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8")
    return raw if kind == "str" else json.loads(raw)


def _map(path: str | None, dtype: str) -> np.ndarray:
  if path is None or os.path.getsize(path) == 0:
    return np.zeros(0, np.dtype(dtype))
  return np.asarray(np.memmap(path, dtype=np.dtype(dtype), mode="r"))


def _offsets(path: str | None) -> np.ndarray | None:
  if path is None:
    return None
  lengths = np.fromfile(path, np.int64)
  return np.concatenate([[0], np.cumsum(lengths)])
