"""The documentation: the Sphinx site builds without warnings, every public name
is in the API reference, every Python block of the README and the guides runs,
and every relative link points at a file (and heading) that exists.

Code blocks run page by page: the ```` ```python ```` blocks of one page are
executed in order in one fresh namespace, so a page's snippets may build on each
other but never on another page's. A block that uses a name it does not define
(found statically, with :mod:`symtable`) must say so on its first line,
``# continues the block above``, and only such a block may say it: a reader who
copies one block sees at once whether it runs alone. A page's run must leave
nothing in the temp folder. A block preceded by the line
``<!-- devices: 4 -->`` needs 4 devices: its whole page then runs in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. A block
preceded by ``<!-- not-run: <reason> -->`` is not executed, and the list of
those blocks must equal ``NOT_RUN`` below, so that nothing is skipped silently.
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import os
import pathlib
import re
import subprocess
import symtable
import sys
import tempfile

import pytest

import jmp_lite

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

# (page, first line of the block) -> why it is not run.
NOT_RUN = {
    ("docs/sharding.md", "import jax"):
        "multi-host: needs jax.distributed.initialize and one process per host",
}

CONTINUES = "# continues the block above"

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*(not-run|devices):\s*(.*?)\s*-->\s*$")


def _blocks(page: pathlib.Path) -> list[tuple[str, str, str]]:
  """``(code, marker, argument)`` for each Python block of ``page``, in order."""
  text = page.read_text()
  blocks = []
  for match in _FENCE.finditer(text):
    before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
    marker = _MARKER.search(before)
    kind, arg = (marker.group(1), marker.group(2)) if marker else ("", "")
    blocks.append((match.group(1), kind, arg))
  return blocks


def _rel(page: pathlib.Path) -> str:
  return page.relative_to(ROOT).as_posix()


def _runnable(page: pathlib.Path) -> tuple[str, bool]:
  """The page's code to run (blocks joined in order) and whether it needs 4 devices."""
  parts, devices = [], False
  for i, (code, kind, arg) in enumerate(_blocks(page)):
    if kind == "not-run":
      continue
    if kind == "devices":
      assert arg == "4", f"{_rel(page)} block {i}: only '<!-- devices: 4 -->' is supported"
      devices = True
    parts.append(f"# --- {_rel(page)}, block {i}\n{code}")
  return "\n".join(parts), devices


def _free_names(code: str) -> set[str]:
  """Names that ``code`` reads but neither defines nor imports (builtins excluded).

  Module-level reads, and reads of globals inside its functions, classes and
  comprehensions, count; names local to those scopes do not.
  """
  top = symtable.symtable(code, "<block>", "exec")
  defined = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
  used = set()
  tables = [top]
  while tables:
    table = tables.pop()
    used |= {s.get_name() for s in table.get_symbols()
             if s.is_referenced() and (table is top or s.is_global())}
    tables.extend(table.get_children())
  return used - defined - set(dir(builtins))


def test_free_names_finds_what_a_block_borrows():
  code = "import jax\nx = f(y)\ndef g(a):\n  return [a + z + x for _ in jax.numpy.ones(2)]\n"
  assert _free_names(code) == {"f", "y", "z"}
  assert _free_names("class C:\n  n = len(w)\nprint(C)\n") == {"w"}


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=_rel)
def test_a_block_that_needs_the_one_above_says_so(page):
  for i, (code, kind, _) in enumerate(_blocks(page)):
    if kind == "not-run":
      continue
    free, says = sorted(_free_names(code)), code.startswith(CONTINUES)
    where = f"{_rel(page)} block {i} ({code.splitlines()[0]!r})"
    assert not (says and i == 0), f"{where}: the first block of a page continues nothing"
    assert says == bool(free), (
        f"{where} uses {free}, defined above it: start it with {CONTINUES!r}, or make it "
        "runnable alone" if free else f"{where} runs alone: drop its {CONTINUES!r} line")


def test_not_run_blocks_are_the_expected_ones():
  found = {}
  for page in PAGES:
    for code, kind, reason in _blocks(page):
      if kind == "not-run":
        found[(_rel(page), code.strip().splitlines()[0])] = reason
  assert found == NOT_RUN


def test_every_page_with_code_has_python_blocks_found():
  # Guards the extractor: a fence it does not recognise would silently run nothing.
  for page in PAGES:
    text = page.read_text()
    assert text.count("```python") == len(_blocks(page)), _rel(page)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=_rel)
def test_page_code_runs(page, tmp_path, monkeypatch):
  code, devices = _runnable(page)
  if not code:
    pytest.skip("every block of this page is marked not-run (see NOT_RUN)")
  # The page's temp folder, which it must leave empty (a guide's checkpoint
  # once stayed behind in /tmp on every run).
  temp = tmp_path / "temp"
  temp.mkdir()
  _run_page(page, code, devices, tmp_path, temp, monkeypatch)
  assert not list(temp.iterdir()), f"{_rel(page)} left {sorted(temp.iterdir())} in the temp folder"


def _run_page(page: pathlib.Path, code: str, devices: bool, tmp_path: pathlib.Path,
              temp: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  if devices:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TMPDIR=str(temp))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=4").strip()
    script = tmp_path / "page.py"
    script.write_text("import warnings\nwarnings.simplefilter('error')\n" + code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{_rel(page)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return
  monkeypatch.chdir(tmp_path)  # Snippets may write files (plots, checkpoints).
  monkeypatch.setattr(tempfile, "tempdir", str(temp))
  namespace = {"__name__": "__docs__"}
  exec(compile(code, _rel(page), "exec"), namespace)


def _extras() -> dict[str, set[str]]:
  """``pyproject.toml``'s dependencies ("") and optional extras, as normalised names."""
  text = (ROOT / "pyproject.toml").read_text()
  lists = re.findall(r"^([\w-]+) = \[\n(.*?)^\]", text, re.S | re.M)
  return {"" if name == "dependencies" else name:
          {_normalise(re.match(r"[A-Za-z0-9_.-]+", req).group()) for req in
           re.findall(r'^\s*"([^"]+)"', body, re.M)} for name, body in lists}


def _normalise(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules(code: str) -> set[str]:
  """The top-level modules that ``code`` imports."""
  names = set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Import):
      names.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module.split(".")[0])
  return names


def test_the_readme_setup_installs_what_the_docs_and_examples_import():
  # The guides once imported equinox, which no set-up command installed.
  setup = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
  extras = _extras()
  local = {p.stem for p in (ROOT / "examples").glob("*.py")} | {"jmp_lite"}
  sources = [code for page in PAGES for code, _, _ in _blocks(page)]
  sources += [p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))]
  modules = set().union(*map(_imported_modules, sources)) - set(sys.stdlib_module_names) - local
  distributions = importlib.metadata.packages_distributions()
  for extra in ("examples", "test"):
    assert f"'.[{extra}]'" in setup, f"the README's set-up installs no '.[{extra}]'"
    installed = extras[""] | extras[extra]
    missing = sorted(m for m in modules
                     if not {_normalise(d) for d in distributions[m]} & installed)
    assert not missing, f"'.[{extra}]' does not install {missing}, which the docs or examples import"


# Markdown files whose relative links are checked: the README, the guides, the
# changelog and the index of the committed benchmark results.
LINKED = [*PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "results" / "README.md"]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"^```.*?^```[ \t]*$|`[^`\n]*`", re.S | re.M)
_HEADING = re.compile(r"^(#{1,3})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _anchors(page: pathlib.Path) -> set[str]:
  """The anchors MyST gives ``page``'s headings (``myst_heading_anchors = 3``)."""
  text = re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.S | re.M)
  anchors = set()
  for _, title in _HEADING.findall(text):
    title = re.sub(r"`([^`]*)`", r"\1", title)             # code spans keep their text
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # links keep their text
    slug = re.sub(r"[^\w\- ]", "", title.lower().replace(" ", "-"))
    unique, i = slug, 1
    while unique in anchors:
      unique, i = f"{slug}-{i}", i + 1
    anchors.add(unique)
  return anchors


def _relative_links(page: pathlib.Path) -> list[str]:
  """The link targets of ``page`` that are neither URLs nor inside code."""
  text = _CODE.sub("", page.read_text())
  return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_anchors_are_myst_slugs():
  page = DOCS / "train_step.md"
  assert "evaluation-in-the-training-precision-make_eval_step" in _anchors(page)
  assert "options" in _anchors(page) and "why-it-works-this-way" in _anchors(page)


@pytest.mark.parametrize("page", LINKED, ids=_rel)
def test_relative_links_point_at_files_and_headings_that_exist(page):
  dead = []
  for target in _relative_links(page):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
      dead.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
    elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
      dead.append(f"{target}: no heading with that anchor in {_rel(file)}")
  assert not dead, f"{_rel(page)} has dead links:\n" + "\n".join(dead)


def test_every_public_name_is_in_the_api_reference():
  source = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^\.\. (?:autoclass|autofunction|py:data):: jmp_lite\.(\w+)",
                              source, re.M))
  assert documented == set(jmp_lite.__all__), (
      f"missing: {sorted(set(jmp_lite.__all__) - documented)}, "
      f"not public: {sorted(documented - set(jmp_lite.__all__))}")


def test_docs_pages_are_in_the_toctree():
  index = (DOCS / "index.md").read_text()
  toctrees = re.findall(r"```\{toctree\}\n(.*?)```", index, re.S)
  listed = {line.strip() for tree in toctrees for line in tree.splitlines()
            if line.strip() and not line.startswith(":")}
  assert listed == {p.stem for p in DOCS.glob("*.md")} - {"index"}


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
       str(DOCS), str(tmp_path / "html")],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert (tmp_path / "html" / "api.html").exists()
