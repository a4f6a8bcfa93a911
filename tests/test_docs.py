"""The documentation: its generated pages match the code, ``mkdocs build --strict`` passes (a
broken link or anchor, a page missing from the nav or a nav entry missing, a bad reference),
and the built site navigates and searches in a browser where one is installed."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  monkeypatch.setitem(nemo._SECTIONS, "cluster", lambda values, tr, config: tr.ignore("cluster", "changed"))
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
  """Every example row on the reward tasks page is one record of the format it names, none dropped."""
  from jaxrm import load_dataset
  from jaxrm.data.drops import DropReport

  with open(os.path.join(ROOT, "docs", "training", "tasks.md")) as f:
    rows = re.findall(r"<!-- row: (\w+) -->\n```json\n(.*?)\n```", f.read())
  assert {name for name, _ in rows} == {"PreferenceDataset", "StepwiseDataset", "RatedDataset"}
  for i, (name, row) in enumerate(rows):
    path = tmp_path / f"{i}.jsonl"
    path.write_text(row + "\n")
    drops = DropReport()
    options = {"attributes": ("helpfulness", "correctness", "verbosity")} if name == "RatedDataset" else {}
    records = load_dataset(name, str(path), drops=drops, **options)
    assert (len(records), drops.total) == (1, 0), (name, row)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """``mkdocs build --strict`` of docs/, once: (its result, the site's directory)."""
  site_dir = str(tmp_path_factory.mktemp("site"))
  result = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site_dir],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about its successor
  )
  return result, site_dir


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
