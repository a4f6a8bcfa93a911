"""The package's layout: which module may import which."""

import ast
import os

import tiny_run

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


def _imports(module: str, path: str, known: set[str]) -> set[str]:
  """The package's modules that ``module`` imports anywhere: top level, in functions, under TYPE_CHECKING."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = path.endswith("__init__.py")
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the module's package, one level up per extra dot
        parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
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
  assert "jaxrm.reward_model" in graph["jaxrm.export"]  # the graph sees the imports
  knots = _components(graph)
  assert not knots, "import cycles:\n" + "\n".join(
      f"{' -> '.join(_path_through(graph, set(k)))} (all of {', '.join(k)} import each other)" for k in knots)


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
    with open(os.path.join(tests_dir, name)) as f:
      tree = ast.parse(f.read(), name)
    for node in ast.walk(tree):
      modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      offenders += [f"{name} imports {m}" for m in modules if m.split(".")[0].startswith("test_")]
  assert not offenders, offenders
