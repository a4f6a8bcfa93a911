"""Every config file in configs/ builds a valid run config; the long-context recipe says what it
promises (its docstring's settings, a mesh of 8 devices, rows that split over the context axis)."""

import glob
import importlib.util
import os

import pytest

from jaxrm.config import from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def _config(path, arg=None):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_file_builds_a_run_config(path):
  from_config_dict(_config(path))  # raises ConfigError on a bad key or value


def test_skywork_recipe_is_the_reported_setting_on_one_8_gpu_host():
  run = from_config_dict(_config(os.path.join(ROOT, "configs", "skywork_v2_llama31_8b.py")))
  assert run.model.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
  assert run.reward.type == "bradley_terry"
  assert run.data.max_length == 16384
  assert (run.train.learning_rate, run.train.lr_scheduler) == (3e-6, "constant_with_warmup")
  assert run.train.warmup_steps > 0 and run.train.global_batch_size == 256
  mesh = run.mesh
  assert mesh.data * mesh.fsdp * mesh.tensor * mesh.context == 8 and mesh.context > 1
  # zigzag deals each row out in 2 x context chunks: every bucketed row length must split evenly
  assert run.data.bucket_multiple % (2 * mesh.context) == 0
  assert run.data.max_length % run.data.bucket_multiple == 0


def test_a_variant_the_recipe_lacks_is_refused_by_name():
  with pytest.raises(ValueError, match="unknown variant 'smoke' of configs/skywork_v2_llama31_8b.py"):
    _config(os.path.join(ROOT, "configs", "skywork_v2_llama31_8b.py"), "smoke")
