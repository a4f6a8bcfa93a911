"""A tiny run refused at its start, before its model loads."""

import os

import pytest
import tiny_run


def refusal(config_dict, monkeypatch) -> str:
  """The ConfigError message that training ``config_dict`` stops with; fails the test if the model
  loads first, or if the refused run leaves its output directory behind."""
  from jaxrm.errors import ConfigError
  from jaxrm.run import trainer

  monkeypatch.setattr(trainer, "_load_model", lambda *a, **k: pytest.fail("the model loaded"))
  with pytest.raises(ConfigError) as e:
    tiny_run.train(config_dict)
  assert not os.path.exists(config_dict.output_dir)
  return str(e.value)
