"""The records of ``benchmarks/figures.json`` that ``scripts/gen_docs.py`` writes the benchmarks
page's "Current figures" table from: each complete, linking a section of the page that shows its
commands, each command running a program of this tree, every file in ``benchmarks/`` read or named,
and a raw result's figures computed from the file, so that a changed result makes the page stale."""

import copy
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gen_docs  # noqa: E402

OPTIONAL = {"raw", "values", "note"}
# Programs a record's command runs that are not files of the tree, and why.
NOT_IN_THE_TREE = {
  "loop_attn_bench.py": "a one-off measurement; its section gives the code the command ran",
}


def page() -> str:
  with open(PAGE) as f:
    return f.read()


def sections() -> dict[str, str]:
  """Each heading of the page (as written) -> its section: the text down to the next heading of its
  level or above, code blocks included (a ``#`` line inside one is not a heading)."""
  lines, heads, in_code = page().splitlines(), [], False
  for i, line in enumerate(lines):
    if line.lstrip().startswith("```"):
      in_code = not in_code
    elif not in_code and (m := re.match(r"(#+) (.+)", line)):
      heads.append((i, len(m[1]), m[2]))
  out = {}
  for j, (start, level, text) in enumerate(heads):
    end = next((i for i, deeper, _ in heads[j + 1 :] if deeper <= level), len(lines))
    out[text] = "\n".join(lines[start:end])
  return out


def one_line(text: str) -> str:
  """Shell text as one line: continuation lines joined, runs of spaces made one."""
  return " ".join(text.replace("\\\n", " ").split())


def programs(command: str) -> list[str]:
  """The files of the tree that ``command`` runs: a Makefile (its target checked), a script, a
  module, or the test files given to pytest."""
  words = shlex.split(command)
  if words[0] == "make":
    with open(os.path.join(ROOT, "Makefile")) as f:
      assert re.search(rf"^{re.escape(words[1])}:", f.read(), re.M), f"{command}: no make target {words[1]}"
    return ["Makefile"]
  if words[0] == "bash" or (words[0].endswith("python") and words[1] != "-m"):
    return [words[1]]
  assert words[0].endswith("python"), f"{command}: a command this test does not know how to read"
  if words[2] == "pytest":
    return [w.split("::")[0] for w in words[3:] if not w.startswith("-")]
  module = words[2].replace(".", "/")
  return [module + ".py" if os.path.exists(os.path.join(ROOT, module + ".py")) else module + "/__init__.py"]


def test_every_record_has_each_field():
  records = gen_docs.figure_records()
  assert len(records) == len({r["question"] for r in records}), "one record per question"
  for record in records:
    fields = set(record)
    assert set(gen_docs.FIGURE_FIELDS) <= fields, (record["question"], set(gen_docs.FIGURE_FIELDS) - fields)
    assert fields <= set(gen_docs.FIGURE_FIELDS) | OPTIONAL, (record["question"], fields)
    assert all(record[key] for key in gen_docs.FIGURE_FIELDS), record["question"]
    assert isinstance(record["commands"], list), record["question"]
    assert ("raw" in record) == ("values" in record), (
      f"{record['question']}: a raw file and its values go together"
    )
    if "raw" in record:
      shown = record["figure"] + record["commit"]
      unused = [name for name in record["values"] if "{" + name not in shown]
      assert unused == [], f"{record['question']}: values not in the figure or commit: {unused}"


def test_each_record_links_a_heading_of_the_page():
  """The link's anchor is the id mkdocs gives the record's heading (its toc extension's, on the page
  as it renders)."""
  import markdown

  md = markdown.Markdown(extensions=["toc", "fenced_code", "tables"])
  md.convert(page())
  ids, todo = {}, list(md.toc_tokens)
  while todo:
    token = todo.pop()
    ids[token["name"]] = token["id"]
    todo += token["children"]
  for record in gen_docs.figure_records():
    heading = record["details"]
    assert heading in sections(), f"{record['question']}: no heading {heading!r} on docs/benchmarks.md"
    assert gen_docs.anchor(heading) == ids[heading.replace("`", "")], heading


def test_each_command_runs_a_program_of_the_tree_and_stands_in_its_section():
  by_heading = sections()
  for record in gen_docs.figure_records():
    for command in record["commands"]:
      assert command in one_line(by_heading[record["details"]]), f"{command!r} not in {record['details']!r}"
      for path in programs(command):
        if os.path.basename(path) not in NOT_IN_THE_TREE:
          assert os.path.exists(os.path.join(ROOT, path)), f"{command}: no {path} in the tree"


def test_every_file_in_benchmarks_is_read_by_a_record_or_named_by_the_page():
  records = gen_docs.figure_records()
  read = {gen_docs.FIGURES} | {r["raw"] for r in records if "raw" in r}
  files = set(os.listdir(os.path.join(ROOT, "benchmarks")))
  assert read <= files, f"records read files that are not in benchmarks/: {read - files}"
  text = page()
  assert [f for f in sorted(files - read) if f"benchmarks/{f}" not in text] == []


def test_a_changed_raw_result_makes_the_page_stale(monkeypatch):
  """A re-run's new median, or the GPU check at another commit, without regenerating the page."""
  read = gen_docs.raw_result
  changed = {
    "cpu_smollm2_vs_trl.json": ("results[name=jaxrm shared_prompt].vs_ratio", "median", 2.5),
    "gpu_check_h200.json": ("steps.compile", "commit", "abc1234"),
  }

  def rerun(name):
    raw = copy.deepcopy(read(name))
    if name in changed:
      path, key, value = changed[name]
      gen_docs.field(raw, path)[key] = value
    return raw

  assert gen_docs.stale() == []
  monkeypatch.setattr(gen_docs, "raw_result", rerun)
  assert gen_docs.stale() == ["docs/benchmarks.md"]
  table = gen_docs.benchmarks_part()
  assert "per-step median: `shared_prompt` 2.50x, unpacked 0.87x" in table
  assert "| one H200 | abc1234 |" in table
  assert "| shared_prompt | 1.21x | 1.25x | **2.50x** |" in gen_docs.vs_trl_part()


def test_a_field_that_names_no_entry_is_an_error_naming_it():
  raw = gen_docs.raw_result("cpu_smollm2_vs_trl.json")
  assert gen_docs.field(raw, "results[name=jaxrm unpacked].vs_ratio.steps") == 6
  with pytest.raises(ValueError, match=r"\[name=jaxrm packed\] picks 0 entries"):
    gen_docs.field(raw, "results[name=jaxrm packed].vs_ratio.median")
  with pytest.raises(ValueError, match=r"\[name=TRL RewardTrainer\] picks 2 entries"):
    gen_docs.field(raw, "results[name=TRL RewardTrainer].pairs_per_s")
  with pytest.raises(ValueError, match="not a path"):
    gen_docs.field(raw, "results..name")


def test_a_field_picks_by_several_conditions():
  """A memory plan's row is one model at one length, mesh and card: all four pick it."""
  raw = gen_docs.raw_result("memory_plan_context.json")
  row = "rows[model=llama3.1-8b,length=131072,mesh=1x2x1x4,target=h100-80gb]"
  assert gen_docs.field(raw, f"{row}.fits.80 GB") is True
  assert gen_docs.field(raw, f"{row}.mesh") == "1x2x1x4"
  with pytest.raises(ValueError, match=r"\[model=llama3.1-8b,length=131072\] picks 8 entries"):
    gen_docs.field(raw, "rows[model=llama3.1-8b,length=131072].total_bytes")
