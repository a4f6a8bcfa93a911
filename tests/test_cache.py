"""The tokenized-example cache: a hit equals a miss field by field, parallel equals serial, any
changed input rebuilds, and processes sharing a cache directory never see a partial entry."""

import copy
import dataclasses
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap

import cache_faults
import numpy as np
import pytest
import tiny_run
from helpers import assistant, user, write_jsonl

from jaxrm.data import cache, formats, sources
from jaxrm.data import tokenize as tk
from jaxrm.data.drops import DropReport

OPTS = tk.TokenizeOptions(max_length=64)


def preference_rows():
  """Chat pairs, some with strength or subset; some dropped by tokenization (too long, identical
  once tokenized) and some by parsing (identical text)."""
  rows = []
  for i in range(40):
    row = {
      "context": [user(f"question {i}: what is {i} + {i}?")],
      "completions": [
        {"rank": 0, "completion": [assistant(f"It is {2 * i}.")]},
        {"rank": 1, "completion": [assistant(f"It is {2 * i + 1}.")]},
      ],
    }
    if i % 7 == 3:
      row["completions"][1]["completion"] = [assistant("so long " * 40)]  # over max_length
    if i % 11 == 5:
      row["completions"][1]["completion"] = row["completions"][0]["completion"]  # dropped while parsing
    if i % 13 == 6:  # the same text once the template has trimmed it: dropped by tokenization
      row["completions"][1]["completion"] = [assistant(f"It is {2 * i}.   ")]
    if i % 3 == 0:
      row["subset"] = ["math", "chat"][i % 2]
    if i % 4 == 1:
      row["strength"] = 0.5 + i
    rows.append(row)
  return rows


def stepwise_rows():
  return [
    {
      "prompt": f"Add {i} and {i}.",
      "completions": [f"{i} + {i}", f"= {2 * i + i % 2}"],
      "labels": [True, i % 2 == 0],
    }
    for i in range(25)
  ]


def reader(path, parse=formats.parse_preference, calls=None):
  """``read_records`` for ``load_tokenized``: the file's rows parsed as the registry does."""

  def read(drops):
    if calls is not None:
      calls.append(path)
    for source, row in sources.read_rows(path):
      record = parse(row, source, drops, subset_field="subset")
      if record is not None:
        yield record

  return read


def today(path, tokenizer, parse=formats.parse_preference, opts=OPTS):
  """Examples and drops as a run made them without the cache: read everything, tokenize serially."""
  drops = DropReport()
  records = list(reader(path, parse)(drops))
  return tk.tokenize_all(records, tokenizer, opts, drops), drops


def assert_same_examples(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert type(g) is type(w)
    for field in dataclasses.fields(w):
      a, b = getattr(g, field.name), getattr(w, field.name)
      if isinstance(b, tuple) and b and isinstance(b[0], np.ndarray):
        assert len(a) == len(b), (w.source, field.name)
        for x, y in zip(a, b):
          assert x.dtype == y.dtype and np.array_equal(x, y), (w.source, field.name)
      elif isinstance(b, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), (w.source, field.name)
      else:
        assert a == b and type(a) is type(b), (w.source, field.name, a, b)


def assert_same_drops(got, want):
  assert want.total > 0
  assert dict(got.counts) == dict(want.counts)
  assert {r: v for r, v in got.examples.items() if v} == {r: v for r, v in want.examples.items() if v}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
  return smollm2_tokenizer


def load(path, tokenizer, cache_dir, *, parse=formats.parse_preference, calls=None, opts=OPTS, **kwargs):
  drops = DropReport()
  source = {"dataset_name": "test", "split": "train", "source": sources.fingerprint(path)}
  examples = cache.load_tokenized(
    reader(path, parse, calls),
    tokenizer=tokenizer,
    options=opts,
    drops=drops,
    source=source,
    cache_dir=cache_dir and str(cache_dir),
    **kwargs,
  )
  return examples, drops


@pytest.mark.parametrize("kind", ["preference", "stepwise"])
def test_a_hit_equals_a_miss_and_todays_examples(tok, tmp_path, kind):
  rows, parse = (
    (preference_rows(), formats.parse_preference)
    if kind == "preference"
    else (stepwise_rows(), formats.parse_stepwise)
  )
  path = write_jsonl(tmp_path / "train.jsonl", rows)
  want, want_drops = today(path, tok, parse)
  calls = []
  miss, miss_drops = load(path, tok, tmp_path / "cache", parse=parse, calls=calls, chunk_size=7)
  hit, hit_drops = load(path, tok, tmp_path / "cache", parse=parse, calls=calls)
  assert len(calls) == 1  # the hit read no record
  for got, drops in ((miss, miss_drops), (hit, hit_drops)):
    assert isinstance(got, cache.CachedExamples)
    assert_same_examples(got, want)
    if kind == "preference":
      assert_same_drops(drops, want_drops)
    else:
      assert drops.total == want_drops.total == 0
  if kind == "preference":  # the optional field and the meta dict both came back
    assert {e.strength for e in hit} > {None} and any(e.meta for e in hit)
    assert hit.num_tokens() == sum(len(ids) for e in want for ids in e.input_ids)


def test_parallel_equals_serial(tok, tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  want, want_drops = today(path, tok)
  # Chunks of 3 over two processes: drops fall in many chunks, merged back in row order.
  serial, serial_drops = load(path, tok, None, chunk_size=3)
  parallel, parallel_drops = load(path, tok, tmp_path / "cache", num_proc=2, chunk_size=3)
  assert isinstance(serial, list) and isinstance(parallel, cache.CachedExamples)
  for got, drops in ((serial, serial_drops), (parallel, parallel_drops)):
    assert_same_examples(got, want)
    assert_same_drops(drops, want_drops)


def test_every_input_is_in_the_key(tok, tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  source = {"dataset_name": "PreferenceDataset", "split": "train", "source": sources.fingerprint(path)}
  base = cache.key_hash(cache.cache_key(source, tok, OPTS))
  other_template = copy.deepcopy(tok)
  other_template.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
  changed = [
    cache.cache_key({**source, "split": "validation"}, tok, OPTS),
    cache.cache_key({**source, "options": {"subset_field": "domain"}}, tok, OPTS),
    cache.cache_key(source, other_template, OPTS),
    *(
      cache.cache_key(source, tok, dataclasses.replace(OPTS, **{f: v}))
      for f, v in (
        ("max_length", 65),
        ("truncation", "left"),
        ("step_separator", "\n\n"),
        ("train_on_last_step_only", True),
      )
    ),
  ]
  hashes = {cache.key_hash(k) for k in changed}
  assert len(hashes) == len(changed) and base not in hashes
  assert cache.key_hash(cache.cache_key(source, copy.deepcopy(tok), OPTS)) == base


def test_a_changed_file_or_version_rebuilds(tok, tmp_path, monkeypatch):
  path = tmp_path / "train.jsonl"
  rows = preference_rows()
  write_jsonl(path, rows)
  calls = []
  load(str(path), tok, tmp_path / "cache", calls=calls)
  os.utime(path, (1, 1))  # touched: same bytes, same data
  load(str(path), tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 1
  rows[0]["context"][0]["content"] = rows[0]["context"][0]["content"].replace("question", "Question")
  write_jsonl(path, rows)  # same size, other content
  changed, _ = load(str(path), tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 2
  assert_same_examples(changed, today(str(path), tok)[0])
  monkeypatch.setattr(cache, "TOKENIZE_VERSION", cache.TOKENIZE_VERSION + 1)
  load(str(path), tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 3


def with_version(name, version):
  """``installed_versions`` as it would read with ``name`` at ``version``."""
  versions = {**cache.installed_versions(), name: version}
  return lambda: dict(versions)


@pytest.mark.parametrize("name", cache.VERSIONED_PACKAGES)
def test_every_installed_version_is_in_the_key(tok, tmp_path, monkeypatch, name):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  source = {"dataset_name": "PreferenceDataset", "split": "train", "source": sources.fingerprint(path)}
  installed = cache.installed_versions()
  assert installed[name]  # the test environment has every one installed
  base = cache.key_hash(cache.cache_key(source, tok, OPTS))
  monkeypatch.setattr(cache, "installed_versions", with_version(name, installed[name]))
  assert cache.key_hash(cache.cache_key(source, tok, OPTS)) == base  # equal versions: the same key
  changed = set()
  for version in (installed[name] + ".post1", "0.0.1", None):
    monkeypatch.setattr(cache, "installed_versions", with_version(name, version))
    changed.add(cache.key_hash(cache.cache_key(source, tok, OPTS)))
  assert len(changed) == 3 and base not in changed


@pytest.mark.parametrize("name", cache.VERSIONED_PACKAGES)
def test_an_upgrade_rebuilds_and_equal_versions_hit(tok, tmp_path, monkeypatch, name):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  calls = []
  before, _ = load(path, tok, tmp_path / "cache", calls=calls)
  installed = cache.installed_versions()
  monkeypatch.setattr(cache, "installed_versions", with_version(name, installed[name]))
  load(path, tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 1  # the same versions read the entry
  monkeypatch.setattr(cache, "installed_versions", with_version(name, installed[name] + ".post1"))
  upgraded, _ = load(path, tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 2 and upgraded.entry != before.entry
  assert upgraded.key["versions"][name] == installed[name] + ".post1"
  assert_same_examples(upgraded, before)
  load(path, tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 2  # the upgraded install reads its own entry from then on


def test_partial_entries_are_never_read(tok, tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  first, _ = load(path, tok, tmp_path / "cache")
  entry = first.entry
  # A crashed writer leaves a temporary directory; a copy without its manifest is not an entry.
  os.rename(entry, entry + ".tmp-123-dead")
  calls = []
  again, _ = load(path, tok, tmp_path / "cache", calls=calls)
  assert calls and again.entry == entry
  assert_same_examples(again, first)


def test_a_bad_row_raises_and_leaves_nothing(tok, tmp_path):
  path = tmp_path / "train.jsonl"
  write_jsonl(path, preference_rows()[:5])
  with open(path, "a") as f:
    f.write('{"context": "x", "completions": [\n')
  with pytest.raises(Exception, match=r"train.jsonl:6: not valid JSON"):
    load(str(path), tok, tmp_path / "cache", num_proc=1)
  assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []


def test_cached_examples_are_views_that_pickle_by_path(tok, tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  examples, _ = load(path, tok, tmp_path / "cache")
  first = examples[0]
  with pytest.raises(ValueError, match="read-only"):
    first.input_ids[0][0] = 1
  assert len(pickle.dumps(examples)) < 500  # grain's workers get the path, not the data
  assert_same_examples(pickle.loads(pickle.dumps(examples)), examples)
  assert_same_examples(examples[1:4], [examples[1], examples[2], examples[3]])
  assert_same_examples([examples[-1]], [examples[len(examples) - 1]])
  with pytest.raises(IndexError):
    examples[len(examples)]


_SHARED_SCRIPT = textwrap.dedent("""
  import hashlib, json, sys, time
  import transformers
  from jaxrm.data import cache, formats, sources
  from jaxrm.data import tokenize as tk
  from jaxrm.data.drops import DropReport

  tokenizer_dir, path, cache_dir = sys.argv[1:]
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  built = []
  def read(drops):
    built.append(True)
    time.sleep(1.0)  # hold the entry long enough that the other process arrives meanwhile
    for source, row in sources.read_rows(path):
      record = formats.parse_preference(row, source, drops, subset_field="subset")
      if record is not None:
        yield record
  drops = DropReport()
  examples = cache.load_tokenized(read, tokenizer=tok, options=tk.TokenizeOptions(max_length=64), drops=drops,
                                  source={"file": sources.fingerprint(path)}, cache_dir=cache_dir)
  digest = hashlib.sha256()
  for e in examples:
    for ids in e.input_ids:
      digest.update(ids.tobytes())
    digest.update(repr((e.ranks, e.margin, e.source, e.meta, e.strength)).encode())
  print(json.dumps({"built": bool(built), "digest": digest.hexdigest(), "drops": dict(drops.counts)}))
""")


def test_two_processes_share_one_cache_directory(tmp_path, cache_root, tok):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  script = tmp_path / "load.py"
  script.write_text(_SHARED_SCRIPT)
  args = [sys.executable, str(script), tiny_run.tokenizer_dir(cache_root), path, str(tmp_path / "cache")]
  env = tiny_run.subprocess_env()
  procs = [
    subprocess.Popen(
      args, cwd=tiny_run.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for _ in range(2)
  ]
  outs = []
  for p in procs:
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-3000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  # One built the entry while the other waited on its lock, then read it.
  assert sorted(o["built"] for o in outs) == [False, True]
  want, want_drops = today(path, tok)
  assert outs[0]["digest"] == outs[1]["digest"] and outs[0]["drops"] == outs[1]["drops"] == dict(
    want_drops.counts
  )
  entries = [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")]
  assert len(entries) == 1 and ".tmp-" not in entries[0]


def test_seeded_damage_is_detected_never_used_and_rebuilt(tok, tmp_path, caplog):
  """Each trial damages one file of the entry (truncated, a flipped bit, emptied): the next load
  warns naming the entry and the file, reads the source again, and returns today's examples."""
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  want, want_drops = today(path, tok)
  calls = []
  first, _ = load(path, tok, tmp_path / "cache", calls=calls)
  caplog.set_level(logging.WARNING, logger="jaxrm.data.cache")
  seen = set()
  for seed in range(24):
    caplog.clear()
    damage = cache_faults.corrupt_cache(str(tmp_path / "cache"), seed)
    seen.add((damage.kind, damage.name.split(".")[-2]))
    assert cache.damaged(first.entry) is not None, damage
    got, drops = load(path, tok, tmp_path / "cache", calls=calls)
    assert len(calls) == seed + 2, damage  # rebuilt from the source
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and first.entry in warnings[0] and damage.name in warnings[0], (
      damage,
      warnings,
    )
    assert got.entry == first.entry and cache.damaged(got.entry) is None
    assert_same_examples(got, want)
    assert_same_drops(drops, want_drops)
  assert {kind for kind, _ in seen} == set(cache_faults.KINDS)
  assert {part for _, part in seen} >= {"values", "lengths", "manifest"}, seen
  for seed, kind in enumerate(cache_faults.KINDS):  # the checksum itself damaged
    damage = cache_faults.corrupt_cache(str(tmp_path / "cache"), seed, (kind,), name=cache.CHECKSUM)
    caplog.clear()
    assert_same_examples(load(path, tok, tmp_path / "cache", calls=calls)[0], want)
    assert len(calls) == 26 + seed and cache.CHECKSUM in caplog.records[0].getMessage(), damage


def test_an_entry_with_a_missing_or_added_file_is_rebuilt(tok, tmp_path, caplog):
  path = write_jsonl(tmp_path / "train.jsonl", preference_rows())
  calls = []
  first, _ = load(path, tok, tmp_path / "cache", calls=calls)
  caplog.set_level(logging.WARNING, logger="jaxrm.data.cache")
  os.remove(os.path.join(first.entry, "strength.null.bin"))
  load(path, tok, tmp_path / "cache", calls=calls)
  open(os.path.join(first.entry, "margin.null.bin"), "ab").close()
  open(os.path.join(first.entry, "extra.bin"), "wb").close()
  again, _ = load(path, tok, tmp_path / "cache", calls=calls)
  assert len(calls) == 3
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert "strength.null.bin is missing" in warnings[0] and "extra.bin" in warnings[1], warnings
  assert_same_examples(again, today(path, tok)[0])
