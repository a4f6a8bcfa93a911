"""The package's layout: which module may import which."""

import ast
import os
import sys

import tiny_run

import jaxrm
from jaxrm import tasks
from jaxrm.data import example_types
from jaxrm.models import families

PACKAGE = "jaxrm"


def _modules() -> dict[str, str]:
  """Module name -> file of every module of the package."""
  root = os.path.join(tiny_run.ROOT, PACKAGE)
  out = {}
  for directory, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(directory, name), tiny_run.ROOT)[:-3].split(os.sep)
        out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(directory, name)
  return out


def _source_files() -> list[str]:
  """Every Python file of the package and of the tests."""
  roots = [os.path.join(tiny_run.ROOT, PACKAGE), os.path.join(tiny_run.ROOT, "tests")]
  return [
    os.path.join(d, n) for root in roots for d, _, files in os.walk(root) for n in files if n.endswith(".py")
  ]


def _parse(source: str, name: str = "<unknown>") -> ast.AST:
  """``ast.parse(source)``, parsed once: CPython 3.11 keeps one recursion counter for every thread's
  parse, so a parse racing another (a thread or a finalizer left by an earlier test of this
  process) can fail with "AST constructor recursion depth mismatch". The files are parsed when
  this module is imported, during collection, before any test runs."""
  if source not in _TREES:
    _TREES[source] = ast.parse(source, name)
  return _TREES[source]


def _parse_file(path: str) -> ast.AST:
  with open(path) as f:
    return _parse(f.read(), path)


_TREES: dict[str, ast.AST] = {}
for _path in _source_files():
  _parse_file(_path)


def _imports(module: str, path: str, known: set[str]) -> set[str]:
  """The package's modules that ``module`` imports anywhere: top level, in functions, under TYPE_CHECKING."""
  tree = _parse_file(path)
  is_package = path.endswith("__init__.py")
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the module's package, one level up per extra dot
        parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
        base = ".".join(parts + ([base] if base else []))
      for alias in node.names:  # `from pkg import submodule` imports the submodule
        out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
  return {m for m in out if m in known and m != module}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan): each is a knot of cycles."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        components.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return components


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
  """A cycle a -> ... -> a inside ``component``, found breadth-first from its first module."""
  start = min(component)
  parents = {start: None}
  queue = [start]
  for v in queue:
    for w in sorted(graph[v] & component):
      if w == start:
        path = [v]  # v back to start
        while path[-1] != start:
          path.append(parents[path[-1]])
        return path[::-1] + [start]
      if w not in parents:
        parents[w] = v
        queue.append(w)
  raise AssertionError(f"no cycle in {sorted(component)}")


def test_no_import_cycles():
  modules = _modules()
  graph = {m: _imports(m, path, set(modules)) for m, path in modules.items()}
  assert "jaxrm.scoring.reward_model" in graph["jaxrm.export"]  # the graph sees the imports
  knots = _components(graph)
  assert not knots, "import cycles:\n" + "\n".join(
    f"{' -> '.join(_path_through(graph, set(k)))} (all of {', '.join(k)} import each other)" for k in knots
  )


def test_cycle_finder_finds_cycles():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set()}
  assert _components(graph) == [["a", "b", "c"]]
  assert _path_through(graph, {"a", "b", "c"}) == ["a", "b", "c", "a"]


def test_no_test_module_imports_another():
  """Shared test code lives in conftest.py and helpers.py, not in another test module."""
  tests_dir = os.path.join(tiny_run.ROOT, "tests")
  offenders = []
  for name in sorted(os.listdir(tests_dir)):
    if not (name.startswith("test_") and name.endswith(".py")):
      continue
    tree = _parse_file(os.path.join(tests_dir, name))
    for node in ast.walk(tree):
      modules = (
        [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else [node.module or ""]
        if isinstance(node, ast.ImportFrom)
        else []
      )
      offenders += [f"{name} imports {m}" for m in modules if m.split(".")[0].startswith("test_")]
  assert not offenders, offenders


# ------------------------------------------------------------------ layers

# Each module (or package, by prefix) and the package modules it may import: layers point one way,
# so a low layer never drags the library in with it.
LAYERS = {
  "jaxrm.errors": set(),
  "jaxrm.sharding": set(),
  "jaxrm.run.metrics": set(),
  "jaxrm.run.host_memory": set(),
  "jaxrm.scoring.kinds": {"jaxrm.errors", "jaxrm.tasks"},
  # A task is what the library asks: it names its batches and losses and reads its rows (jaxrm.data),
  # and imports nothing above them.
  "jaxrm.tasks": {"jaxrm.tasks", "jaxrm.data", "jaxrm.run.metrics", "jaxrm.errors"},
  # What a server route reads and answers (a task's routes are written with it): no server code.
  "jaxrm.tasks.routes": {"jaxrm.data"},
  # An LM-head task's question and answers: data the config, loading and scoring ask.
  "jaxrm.tasks.asker": {"jaxrm.errors"},
  "jaxrm.tasks.losses": {"jaxrm.data.batches", "jaxrm.run.metrics"},
  "jaxrm.models": {"jaxrm.errors", "jaxrm.sharding", "jaxrm.models"},
  # Family specs are data that the model config asks: they import no model code.
  "jaxrm.models.families": {"jaxrm.errors", "jaxrm.models.families"},
  "jaxrm.hf": {"jaxrm.errors", "jaxrm.sharding", "jaxrm.models", "jaxrm.hf"},
  # Which writes the file system refused, and what the user needs: the standard library only.
  "jaxrm.run.refused_writes": set(),
  "jaxrm.run.checkpointing": {"jaxrm.errors", "jaxrm.run.metrics", "jaxrm.run.refused_writes"},
  "jaxrm.run.run_lock": {"jaxrm.errors", "jaxrm.run.refused_writes"},
  "jaxrm.data.batches": set(),
  # Reading, tokenizing and batching rows: the settings are checked where they live (jaxrm.config,
  # named here for run_data's type annotations only), not by the data modules.
  "jaxrm.data": {
    "jaxrm.data",
    "jaxrm.config",
    "jaxrm.errors",
    "jaxrm.sharding",
    "jaxrm.tasks",
  },
}


def _layer(module: str) -> str | None:
  return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)


def _allowed(module: str, imported: str) -> bool:
  return any(imported == p or imported.startswith(p + ".") for p in LAYERS[_layer(module)])


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {m: _imports(m, path, set(modules)) for m, path in modules.items()}


def _depth(graph: dict[str, set[str]]):
  """module -> its import layer: 0 for a module that imports none of the package, else one more
  than the highest module it imports."""
  depth = {}

  def of(m):
    if m not in depth:
      depth[m] = 1 + max((of(d) for d in graph.get(m, ())), default=-1)
    return depth[m]

  return of


class _Enough(BaseException):
  """Stops the run being followed (no ``except Exception`` in it catches this)."""


def test_the_run_config_goes_back_up_the_layers_fewer_than_10_times(model_dir, tmp_path):
  """Following the run config from ``trainer.train_and_evaluate`` through its first 400 calls into
  the package: a call that returns into a module of a higher import layer is a step back up.
  Fewer than 10: the set-up asks each layer once (the config parses its keys once, the data
  modules take what the config parsed) instead of bouncing between trainer, config, loading and
  the data modules (14 such returns before). Seven were left once that was mended, six once the LoRA
  check asked first whether the model is a run's; three more are asks a run must make: whether the
  folder holds a run to compare with, whatever its checkpoints,
  whether an outside checkpoint folder is another run's, and whether the model path is a run's
  folder (loading asks the run folder's module, which owns its layout)."""
  from jaxrm import cli
  from jaxrm.run import trainer

  depth = _depth(_graph())
  config = cli.run_config(tiny_run.config(model_dir, str(tmp_path / "run")))
  stack, ups, calls = [], [], 0

  def follow(frame, event, arg):
    nonlocal calls
    module = frame.f_globals.get("__name__", "")
    if event not in ("call", "return") or not module.startswith(PACKAGE + "."):
      return
    if event == "call":
      calls += 1
      if calls > 400:
        sys.setprofile(None)
        raise _Enough
      stack.append((module, frame.f_code.co_name))
    elif stack:
      callee = stack.pop()
      caller = stack[-1] if stack else ("jaxrm.run.trainer", "train_and_evaluate")
      if caller[0] != callee[0] and depth(caller[0]) > depth(callee[0]):
        ups.append(f"{callee[0]}.{callee[1]} -> {caller[0]}.{caller[1]}")

  sys.setprofile(follow)
  try:
    trainer.train_and_evaluate(config)
  except _Enough:
    pass
  finally:
    sys.setprofile(None)
  assert calls > 400  # the set-up ran that far: the count covers the whole window
  assert len(ups) < 10, "\n".join(ups)


def test_the_commands_are_the_modules_run_as_scripts():
  """Entry points in one place: every module with a ``__main__`` block is one of
  ``jaxrm.COMMANDS``, at the package's top level, and defines ``main``."""
  scripts = set()
  for module, path in _modules().items():
    tree = _parse_file(path)
    for node in tree.body:
      if (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
      ):
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "main" in defined, f"{module} runs as a script without a main()"
        scripts.add(module)
  assert scripts == {f"{PACKAGE}.{c}" for c in jaxrm.COMMANDS}, sorted(scripts)


def test_layers_import_nothing_above_them():
  graph = _graph()
  assert "jaxrm.models.config" in graph["jaxrm.hf.loader"]  # the graph sees the imports
  wrong = sorted(f"{m} imports {i}" for m in graph if _layer(m) for i in graph[m] if not _allowed(m, i))
  assert not wrong, "imports from a higher layer:\n" + "\n".join(wrong)


def test_the_hf_writer_imports_only_model_and_tensor_code():
  graph = _graph()
  closure, todo = set(), ["jaxrm.hf.export"]
  while todo:
    for m in graph[todo.pop()] - closure:
      closure.add(m)
      todo.append(m)
  assert {m.split(".")[1] for m in closure} <= {"errors", "sharding", "models", "hf"}, sorted(closure)


def test_only_the_families_package_names_a_family():
  """A family is one file: no module elsewhere compares against a family's name, model_type or GGUF
  architecture; it asks the family's spec."""
  spellings = set()
  for fam in families.FAMILIES:
    spellings |= {fam.name, fam.model_type, fam.multimodal_model_type, fam.gguf and fam.gguf.architecture}
  spellings.discard(None)
  found = []
  for module, path in _modules().items():
    if module.startswith("jaxrm.models.families"):
      continue
    tree = _parse_file(path)
    found += [
      f"{module} line {n.lineno}: {n.value!r}"
      for n in ast.walk(tree)
      if isinstance(n, ast.Constant) and n.value in spellings
    ]
  assert "gemma3_text" in spellings and not found, found


# Modules that still compare task names, each with what it should ask instead.


def test_only_the_tasks_module_compares_task_names():
  """A task is one object in jaxrm.tasks: no module elsewhere compares a value against a task's name,
  the rows it reads or its evaluation reading; it asks the task (config.reward.task, registry.task,
  tasks.of_head)."""
  spellings = {s for t in tasks.TASKS.values() for s in (t.name, t.data, t.evaluation)}
  found = []
  for module, path in _modules().items():
    if module == "jaxrm.tasks":
      continue
    tree = _parse_file(path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        values = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.Set)) else [o])]
        found += [
          f"{module} line {node.lineno}: {v.value!r}"
          for v in values
          if isinstance(v, ast.Constant) and v.value in spellings
        ]
  assert {"regression", "stepwise", "rated"} <= spellings and not found, found


# The modules a particular task's object is read from: the tasks package, and jaxrm.scoring.kinds (which
# once kept a name per task).
TASK_HOMES = ("jaxrm.tasks", "jaxrm.scoring.kinds")


def _task_names() -> set[str]:
  """The names the tasks package binds to a task object (PAIRWISE, VERIFIER...)."""
  homes = [m for name, m in sys.modules.items() if name == "jaxrm.tasks" or name.startswith("jaxrm.tasks.")]
  return {n for m in homes for n, v in vars(m).items() if any(v is t for t in tasks.TASKS.values())}


def _task_references(source: str, names: set[str]) -> list[str]:
  """Where ``source`` reads a task object by its name (``names``) from TASK_HOMES: ``tasks.PAIRWISE``,
  ``kinds.PROCESS``, ``pairwise.PAIRWISE``, ``jaxrm.tasks.VERIFIER`` or ``from jaxrm.tasks import
  PREFERENCE``."""
  tree = _parse(source)
  homes = {}  # a name bound in the module -> the module it stands for
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        homes[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module:
      for a in node.names:
        homes[a.asname or a.name] = f"{node.module}.{a.name}"
        home = node.module.startswith(TASK_HOMES[0]) or node.module == TASK_HOMES[1]
        if home and a.name in names:
          found.append(f"line {node.lineno}: from {node.module} import {a.name}")
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in names:
      first, *rest = ast.unparse(node.value).split(".")
      module = ".".join([homes.get(first, first), *rest])
      if module == TASK_HOMES[1] or module == TASK_HOMES[0] or module.startswith(TASK_HOMES[0] + "."):
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return found


def test_no_module_outside_the_tasks_package_names_a_task():
  """A task is asked, never named: outside jaxrm.tasks no module reads a particular task's object
  (``tasks.PROCESS``, ``kinds.PREFERENCE``, ``from jaxrm.tasks.pairwise import PAIRWISE``); it asks
  what a task declares (Task.scores through tasks.scoring and tasks.scores_of, its head, its asker)."""
  names = _task_names()
  found = []
  for module, path in _modules().items():
    if module == "jaxrm.tasks" or module.startswith("jaxrm.tasks."):
      continue
    with open(path) as f:
      found += [f"{module} {hit}" for hit in _task_references(f.read(), names)]
  assert {"PAIRWISE", "PREFERENCE", "PROCESS", "REGRESSION", "VERIFIER"} <= names  # the scan knows them
  assert not found, found


def _task_files() -> set[str]:
  """The tasks package's modules that define a task (preference, process, ..., pairwise)."""
  return {
    name
    for name, m in sys.modules.items()
    if name.startswith("jaxrm.tasks.") and any(v is t for v in vars(m).values() for t in tasks.TASKS.values())
  }


def test_no_module_outside_the_tasks_package_imports_a_task_file():
  """A task's whole path is in its file: outside jaxrm.tasks no module imports one (the judge's
  verbs, route, RL rewards, evaluation and settings reach the library as hooks of its Task), so a
  new task's change is its own file, its registry entry, its tests and its docs. The package's
  generic modules (base, asker, routes, losses) are the ones the others import."""
  files = _task_files()
  known = set(_modules())
  found = sorted(
    f"{module} imports {imported}"
    for module, path in _modules().items()
    if not module.startswith("jaxrm.tasks")
    for imported in _imports(module, path, known)
    if imported in files
  )
  assert {"jaxrm.tasks.pairwise", "jaxrm.tasks.verifier", "jaxrm.tasks.preference"} <= files
  assert not found, found


# What stands at the package's top besides the commands (jaxrm.COMMANDS): what every command and
# room shares. Everything else is in a room (a subpackage) named for what it is.
TOP = {"jaxrm", "jaxrm.cli", "jaxrm.config", "jaxrm.errors", "jaxrm.sharding"}


def test_the_package_top_holds_the_commands_and_what_they_share():
  """Read from the top, the tree says how jaxrm works: the commands, what they share, and the rooms
  (a training run, scoring and its uses, planning for GPUs, tasks, data, models...)."""
  top = {
    m
    for m in _modules()
    if m.count(".") == 1 and not os.path.isdir(os.path.join(tiny_run.ROOT, *m.split(".")))
  }
  assert top - {"jaxrm"} == (TOP - {"jaxrm"}) | {f"{PACKAGE}.{c}" for c in jaxrm.COMMANDS}, sorted(top)
  rooms = {m.split(".")[1] for m in _modules() if m.count(".") >= 2}
  assert {"run", "scoring", "planning", "tasks", "data", "models", "hf", "server", "evaluation"} <= rooms


def test_the_task_reference_finder_finds_them():
  source = (
    "import jaxrm.tasks as t\nfrom jaxrm.scoring import kinds; from jaxrm import tasks\nfrom jaxrm.tasks import pairwise, PROCESS\n"
    "import jaxrm\nfrom jaxrm.data import example_types\n"
    "t.VERIFIER; kinds.PREFERENCE; tasks.PAIRWISE.name; pairwise.PAIRWISE; jaxrm.tasks.REGRESSION\n"
    "example_types.PREFERENCE; tasks.TASKS; other.PROCESS\n"
  )
  assert sorted(_task_references(source, _task_names())) == [
    "line 3: from jaxrm.tasks import PROCESS",
    "line 6: jaxrm.tasks.REGRESSION",
    "line 6: kinds.PREFERENCE",
    "line 6: pairwise.PAIRWISE",
    "line 6: t.VERIFIER",
    "line 6: tasks.PAIRWISE",
  ]


# The modules that say what each kind of row is: the records, their tokenizers, the kinds' own table
# (how each is batched and packed) and the tasks. Everything else asks example_types.of_example.
ROW_OWNERS = ("jaxrm.data.records", "jaxrm.data.tokenize", "jaxrm.data.example_types", "jaxrm.tasks")


def _named(node) -> str | None:
  return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _row_class_tests(path: str, classes: set[str]) -> list[tuple[int, str]]:
  """(line, class) of every isinstance / issubclass / comparison of ``path`` that names one of ``classes``."""
  tree = _parse_file(path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and _named(node.func) in ("isinstance", "issubclass"):
      operands = node.args[1:]
    elif isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
    else:
      continue
    flat = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.Set, ast.List)) else [o])]
    found += [(node.lineno, n) for n in map(_named, flat) if n in classes]
  return found


def test_only_the_row_owners_branch_on_a_kind_of_row():
  """No module outside ROW_OWNERS tests a value against a particular record or example class
  (isinstance, issubclass, ``type(x) is``): the pipeline, the packer, the run's data checks, the fit
  check and evaluation ask the row's kind (jaxrm.data.example_types.of_example, Task.example_types)."""
  classes = {c.__name__ for t in example_types.TYPES for c in (t.record, t.example)}
  owned, found = [], []
  for module, path in _modules().items():
    hits = [f"{module} line {line}: {name}" for line, name in _row_class_tests(path, classes)]
    owner = any(module == o or module.startswith(o + ".") for o in ROW_OWNERS)
    (owned if owner else found).extend(hits)
  assert len(classes) == 8 and any("jaxrm.data.tokenize" in h for h in owned)  # the scan sees them
  assert not found, found


# What interprets a model path: only jaxrm.scoring.loading says what a path names, and whether a folder
# is a run's only the run folder's module (which owns its layout) and those refusing to write into one.
PATH_CALLS = {"snapshot_download", "is_run_dir", "embedded_model_path", "HFCheckpoint", "GGUFCheckpoint"}
PATH_STRINGS = ("model_config.json", "embedded:", ".gguf")
PATH_OWNERS = {
  "jaxrm.scoring.loading",
  "jaxrm.run.run_files",
  "jaxrm.scoring.export_files",
  "jaxrm.hf.gguf",
  "jaxrm.hf.safetensors_io",
}


def _path_interpretations(path: str) -> list[str]:
  tree = _parse_file(path)
  docstrings = {
    id(n.body[0].value)
    for n in ast.walk(tree)
    if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
    and n.body
    and isinstance(n.body[0], ast.Expr)
    and isinstance(n.body[0].value, ast.Constant)
  }
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      f = node.func
      name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
      if name in PATH_CALLS:
        found.append(f"line {node.lineno}: calls {name}")
      if name in ("startswith", "endswith") and any(
        isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value in PATH_STRINGS
        for a in node.args
      ):
        found.append(f"line {node.lineno}: {name}({node.args[0].value!r})")
    elif isinstance(node, ast.Constant) and node.value == "model_config.json" and id(node) not in docstrings:
      found.append(f"line {node.lineno}: 'model_config.json'")
  return found


def test_only_the_loading_module_interprets_model_paths():
  found = {m: _path_interpretations(p) for m, p in _modules().items() if m not in PATH_OWNERS}
  found = {m: f for m, f in found.items() if f}
  assert "jaxrm.scoring.loading" in _modules() and _path_interpretations(
    _modules()["jaxrm.scoring.loading"]
  )  # it sees them
  assert not found, found


# ------------------------------------------------------------------ tests use the front door

# Test modules allowed to read a private name, each with its reason (none now). A fault injected into a private
# function goes through helpers.around or monkeypatch.setattr by name, which this check allows.
PRIVATE_READS: dict[str, set[str]] = {}


def _is_private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def _is_package_module(name: str) -> bool:
  path = os.path.join(tiny_run.ROOT, *name.split("."))
  return os.path.isdir(path) or os.path.isfile(path + ".py")


def _private_reads(tree: ast.AST) -> set[str]:
  """The package's private names a module reads: ``from jaxrm.x import _y``, and ``m._y`` where
  ``m`` names a module of the package (imported as a module, or reached from one)."""
  bound, out = {}, set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] == PACKAGE:
          bound[a.asname or PACKAGE] = a.name if a.asname else PACKAGE
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
      for a in node.names:
        if _is_private(a.name):
          out.add(f"{node.module}.{a.name}")
        elif _is_package_module(f"{node.module}.{a.name}"):
          bound[a.asname or a.name] = f"{node.module}.{a.name}"

  def module_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
      return bound.get(node.id)
    if isinstance(node, ast.Attribute) and (base := module_of(node.value)):
      return f"{base}.{node.attr}"
    return None

  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _is_private(node.attr) and (base := module_of(node.value)):
      out.add(f"{base}.{node.attr}")
  return out


def test_tests_read_no_private_name_of_the_package():
  """Tests go through the package's public interface (or a seam it documents), so that its insides
  can change under them; the exceptions above say why."""
  tests_dir = os.path.join(tiny_run.ROOT, "tests")
  offenders, unused = [], []
  for name in sorted(os.listdir(tests_dir)):
    if name.endswith(".py"):
      reads = _private_reads(_parse_file(os.path.join(tests_dir, name)))
      allowed = PRIVATE_READS.get(name, set())
      offenders += [f"{name} reads {r}" for r in sorted(reads - allowed)]
      unused += [f"{name}: {r}" for r in sorted(allowed - reads)]
  assert not offenders, offenders
  assert not unused, f"exceptions no longer needed, remove them: {unused}"


def test_the_private_name_finder_finds_reads():
  tree = _parse(
    "import jaxrm.run.trainer as t\nfrom jaxrm import data\nfrom jaxrm.scoring import loading\nfrom jaxrm.data.batches import _x, IGNORE_INDEX\n"
    "import jaxrm\nt._a; data.tokenize._b; loading.public; jaxrm.cli._c; IGNORE_INDEX._d; other._e\n"
    "monkeypatch.setattr(loading, '_f', None)\n"
  )
  assert _private_reads(tree) == {
    "jaxrm.run.trainer._a",
    "jaxrm.data.tokenize._b",
    "jaxrm.data.batches._x",
    "jaxrm.cli._c",
  }
