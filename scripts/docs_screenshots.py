"""The documentation site as a reader meets it: built, served, clicked through and searched in a
headless Chromium, with a screenshot of each page it reaches.

  python scripts/docs_screenshots.py --out=/tmp/docs-shots

It builds the site (``mkdocs build --strict`` into a temporary directory; ``--site=DIR`` takes one
already built), serves it on 127.0.0.1, opens the home page, follows the navigation by clicking
the sidebar's links (:data:`NAV`), and types each of :data:`SEARCHES` (a reader's question, in
the words a reader would type) into the site's search box: the results must appear, the expected
page must be among the first :data:`TOP` of them, and clicking it must open that page with the
expected words on it. It exits 1 naming every check that failed (a click that led elsewhere, a
search without the page, a missing asset, a JavaScript error), and 2 where no Chromium or no
playwright is found. ``--out`` receives one PNG per step
(``NN-name.png``) and ``searches.txt``: each query's first results, as a reader sees them.

It needs the ``playwright`` Python package (in the ``test`` extra) and a Chromium; playwright's own
browser download is not used (do not run ``playwright install``: the system's Chromium is). On
Debian::

  apt-get install -y chromium

``--chromium`` names the browser (default: ``$CHROMIUM``, else ``chromium`` or ``chromium-browser``
on the PATH). ``tests/test_docs.py`` runs this on the site it builds where both are installed, and
skips it elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM_ARGS = (
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
)
VIEWPORT = {"width": 1280, "height": 900}  # wide enough for Material's navigation sidebar
TIMEOUT_MS = 20_000
TOP = 5  # a search answers when the page is among its first results

# Sidebar links clicked in turn, from the home page: (link text, the page's path in the site).
NAV = (
  ("Getting started", "getting-started/"),
  ("Reward tasks and data", "training/tasks/"),
  ("Packing", "training/packing/"),
  ("Coming from NeMo RL", "coming-from-nemo/"),
  ("verl", "verl/"),
  ("Configuration", "reference/config/"),
  ("Benchmarks", "benchmarks/"),
)


@dataclasses.dataclass(frozen=True)
class Search:
  """A reader's question, the words they would type, and where the answer is."""

  name: str
  query: str
  page: str  # the page's path in the site
  expect: str  # words on that page that answer the question


SEARCHES = (
  Search("own-data", "train on my own data", "getting-started/", "--config.data.train_data_path=train.jsonl"),
  Search("trl-jsonl", "TRL jsonl", "getting-started/", "TRL's form"),
  Search(
    "nemo-max-total-sequence-length",
    "max_total_sequence_length",
    "coming-from-nemo/",
    "policy.max_total_sequence_length becomes data.max_length",
  ),
  Search("verl", "verl", "verl/", "reward.custom_reward_function.path=pkg://jaxrm.integrations.verl"),
  Search("llama-8b-16k-8xh100", "Llama-3.1-8B 16k H100", "training/long-context/", "32.0 GiB per device"),
  Search("shared-prompt", "shared_prompt", "training/packing/", "computes a pair's prompt once"),
)


def find_chromium() -> str | None:
  for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
    if name and (path := shutil.which(name)):
      return path
  return None


def build_site(site_dir: str) -> subprocess.CompletedProcess:
  """``mkdocs build --strict`` into ``site_dir`` (a warning fails it): the finished process."""
  return subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site_dir],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about its successor
  )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


@contextlib.contextmanager
def serve(site_dir: str):
  """The site on 127.0.0.1 at a free port; yields its base URL."""
  server = http.server.ThreadingHTTPServer(
    ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=site_dir)
  )
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}/"
  finally:
    server.shutdown()
    server.server_close()


class Check:
  """Screenshots numbered in the order taken, and the failures met on the way."""

  def __init__(self, page, base: str, out: str):
    self.page, self.base, self.out = page, base, out
    self.failures: list[str] = []
    self.shots: list[str] = []
    page.on("pageerror", lambda e: self.failures.append(f"JavaScript error on {page.url}: {e}"))
    page.on("response", self._missing)

  def _missing(self, response) -> None:
    if response.status >= 400:
      self.failures.append(f"{response.status} for {response.url} (from {self.page.url})")

  def shot(self, name: str) -> None:
    path = os.path.join(self.out, f"{len(self.shots) + 1:02d}-{name}.png")
    self.page.screenshot(path=path)
    self.shots.append(path)

  def path(self) -> str:
    """The page's path in the site, without its anchor."""
    return urllib.parse.urlsplit(self.page.url).path.lstrip("/")

  def at(self, expected: str, what: str) -> bool:
    if self.path() != expected:
      self.failures.append(f"{what}: expected /{expected}, got {self.page.url}")
      return False
    if not self.page.locator("article h1").first.is_visible():
      self.failures.append(f"{what}: /{expected} shows no title")
      return False
    return True


def click_nav(check: Check, text: str, expected: str) -> None:
  """Clicks the primary sidebar's link named ``text`` and checks where it leads."""
  page = check.page
  link = page.locator("nav.md-nav--primary a.md-nav__link").filter(has=page.get_by_text(text, exact=True))
  if link.count() == 0:
    link = page.locator("nav.md-nav--primary").get_by_role("link", name=text, exact=True)
  if link.count() == 0:
    check.failures.append(f"navigation: no sidebar link {text!r} on {page.url}")
    return
  link.first.click()
  page.wait_for_load_state("load")
  if check.at(expected, f"navigation to {text!r}"):
    active = page.locator("nav.md-nav--primary .md-nav__link--active").first.inner_text().strip()
    if active != text:
      check.failures.append(f"navigation to {text!r}: the sidebar marks {active!r} as the page")
  check.shot("nav-" + expected.strip("/").replace("/", "-"))


def search(check: Check, s: Search, report: list[str]) -> None:
  """Types ``s.query`` into the search box, checks the results, and opens ``s.page`` from them."""
  page = check.page
  page.goto(check.base)
  page.locator(".md-search__input").click()
  page.locator(".md-search__input").press_sequentially(s.query, delay=30)
  meta = page.locator(".md-search-result__meta")
  try:
    page.wait_for_function(
      "() => /matching document/.test(document.querySelector('.md-search-result__meta').textContent)",
      timeout=TIMEOUT_MS,
    )
  except Exception:
    check.failures.append(f"search {s.query!r}: no results ({meta.inner_text().strip()!r})")
    check.shot(f"search-{s.name}")
    return
  items = page.locator("li.md-search-result__item > a.md-search-result__link")
  hrefs = [items.nth(i).evaluate("a => a.href") for i in range(min(items.count(), TOP))]
  titles = [items.nth(i).locator("h1, h2").first.inner_text().strip() for i in range(len(hrefs))]
  report.append(f"{s.query!r} ({meta.inner_text().strip()}):")
  for i, (title, href) in enumerate(zip(titles, hrefs)):
    url = urllib.parse.urlsplit(href)
    report.append(f"  {i + 1}. {title}  {url.path}{'#' + url.fragment if url.fragment else ''}")
  check.shot(f"search-{s.name}")
  hits = [i for i, h in enumerate(hrefs) if urllib.parse.urlsplit(h).path.lstrip("/") == s.page]
  if not hits:
    check.failures.append(f"search {s.query!r}: /{s.page} is not among the first {TOP} results")
    return
  # The page's section that matched, where the results name one: where a reader would click.
  hit = next((i for i in hits if urllib.parse.urlsplit(hrefs[i]).fragment), hits[0])
  items.nth(hit).click()
  page.wait_for_load_state("load")
  if check.at(s.page, f"search {s.query!r}, result {hit + 1}"):
    if s.expect not in page.locator("article").inner_text():
      check.failures.append(f"search {s.query!r}: /{s.page} does not say {s.expect!r}")
  check.shot(f"result-{s.name}")


def run(site_dir: str, out: str, chromium: str) -> list[str]:
  """Every check on the built site in ``site_dir``; returns the failures."""
  from playwright.sync_api import sync_playwright

  os.makedirs(out, exist_ok=True)
  report: list[str] = []
  with serve(site_dir) as base, tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
    browser = p.chromium.launch_persistent_context(
      profile, executable_path=chromium, headless=True, args=list(CHROMIUM_ARGS), viewport=VIEWPORT
    )
    try:
      page = browser.new_page()
      page.set_default_timeout(TIMEOUT_MS)
      check = Check(page, base, out)
      page.goto(base)
      if check.at("", "home page") and "jaxrm" not in page.title():
        check.failures.append(f"home page: title {page.title()!r}")
      check.shot("home")
      for text, expected in NAV:
        click_nav(check, text, expected)
      for s in SEARCHES:
        search(check, s, report)
    finally:
      browser.close()
  with open(os.path.join(out, "searches.txt"), "w") as f:
    f.write("\n".join(report) + "\n")
  print("\n".join(report))
  print("\n".join(check.shots))
  return check.failures


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="folder for the PNGs and searches.txt")
  parser.add_argument("--site", help="an already built site (default: build one into a temporary folder)")
  parser.add_argument("--chromium", default=find_chromium(), help="the Chromium executable")
  args = parser.parse_args(argv)
  if not args.chromium:
    print("no Chromium found: install it (apt-get install chromium) or pass --chromium", file=sys.stderr)
    return 2
  if not shutil.which(args.chromium):
    print(
      f"--chromium={args.chromium}: no such executable (on this PATH: {find_chromium() or 'no Chromium'})",
      file=sys.stderr,
    )
    return 2
  try:
    import playwright  # noqa: F401
  except ImportError:
    print("the playwright package is missing: pip install playwright", file=sys.stderr)
    return 2
  with tempfile.TemporaryDirectory() as tmp:
    site = args.site
    if not site:
      site = os.path.join(tmp, "site")
      built = build_site(site)
      if built.returncode:
        print(f"mkdocs build --strict failed:\n{built.stdout}{built.stderr}", file=sys.stderr)
        return 1
    failures = run(site, args.out, args.chromium)
  for failure in failures:
    print("FAILED:", failure, file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
