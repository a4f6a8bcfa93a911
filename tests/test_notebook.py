"""notebooks/quickstart.ipynb runs top to bottom in a kernel of this Python (about two minutes on CPU)."""

import json
import math
import os
import re
import shutil
import sys

import nbformat
import pytest
import tiny_run
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK = os.path.join(tiny_run.ROOT, "notebooks", "quickstart.ipynb")
KERNEL = "jaxrm-test-python"


def kernel_manager(kernels_dir) -> KernelManager:
  """A kernel running this interpreter: the installed ``python3`` spec runs whatever ``python`` is on PATH."""
  spec = kernels_dir / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(
    json.dumps(
      {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxrm tests",
        "language": "python",
      }
    )
  )
  return KernelManager(
    kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels_dir)])
  )


def outputs(cell, kind):
  """Text of a cell's stdout (kind="stdout"), or its outputs of a MIME type such as image/png."""
  if kind == "stdout":
    return "".join(o["text"] for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
  return [o for o in cell.outputs if o.output_type in ("display_data", "execute_result") and kind in o.data]


def test_stored_notebook_has_no_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_imports_only_from_jaxrm_itself():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  lines = [line.strip() for cell in nb.cells if cell.cell_type == "code" for line in cell.source.splitlines()]
  imports = [line for line in lines if re.match(r"(from|import) jaxrm\b", line)]
  assert imports and all(line.startswith("from jaxrm import ") for line in imports), imports


@pytest.mark.slow
def test_quickstart_runs(tmp_path, request, tmp_path_factory):
  tiny_run.enable_compile_cache(tiny_run.cache_root(request, tmp_path_factory))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(
    nb,
    km=kernel_manager(tmp_path / "kernels"),
    timeout=600,
    resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
  )
  scratch = tmp_path / "tmp"  # the notebook's run directory, with a 1.2 GB checkpoint
  scratch.mkdir()
  env = tiny_run.subprocess_env(tiny_run.REAL_MODEL_XLA_FLAGS, TMPDIR=str(scratch))
  try:
    client.execute(env=env)  # raises CellExecutionError
  finally:
    shutil.rmtree(scratch, ignore_errors=True)

  code = [c for c in nb.cells if c.cell_type == "code"]
  assert outputs(code[0], "stdout") == "llama, 30 layers, sequence head\n"
  scored = outputs(code[1], "stdout").splitlines()
  assert [line.split("  ", 1)[1] for line in scored] == ["17 + 25 = 42.", "17 + 25 = 43.", "Paris."]
  assert all(math.isfinite(float(line.split()[0])) for line in scored)
  validation = outputs(code[2], "stdout").splitlines()[-1]
  assert "'validation-default_accuracy'" in validation
  assert len(outputs(code[3], "image/png")) == 1  # the loss curve
  assert len(outputs(code[4], "image/png")) == 1  # the reward histogram
  summary = json.loads(outputs(code[4], "stdout").splitlines()[-1])
  assert summary["steps"] == 3
  assert math.isfinite(summary["final_train_loss"]) and summary["final_train_loss"] > 0
  assert 0 <= summary["validation_accuracy"] <= 1
  assert math.isfinite(summary["chosen_reward"]) and math.isfinite(summary["rejected_reward"])
