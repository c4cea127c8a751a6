"""Every command line (the examples' and the benchmarks') documents each option and its default."""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ("train_digits", "char_lm", "transformer_lm", "underflow", "weight_updates")
BENCHMARKS = ("run", "sweep", "masters", "autocast", "gpu_compile", "call_overhead", "optim_state",
              "gpu_run", "optim_oracle")


def _build_parser(monkeypatch, kind: str, name: str) -> argparse.ArgumentParser:
  if kind == "examples":
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for mod in (name, "_common", "char_lm"):
      monkeypatch.delitem(sys.modules, mod, raising=False)
    return importlib.import_module(name).build_parser()
  return importlib.import_module(f"benchmarks.{name}").build_parser()


@pytest.mark.parametrize(
    "kind, name",
    [("examples", n) for n in EXAMPLES] + [("benchmarks", n) for n in BENCHMARKS],
)
def test_help_documents_every_option_and_its_default(monkeypatch, capsys, kind, name):
  parser = _build_parser(monkeypatch, kind, name)
  with pytest.raises(SystemExit) as exc:
    parser.parse_args(["--help"])
  assert exc.value.code == 0
  text = capsys.readouterr().out
  # argparse has no public list of a parser's options; _actions has held them since 2.7.
  options = [a for a in parser._actions  # pylint: disable=protected-access
             if a.option_strings and "-h" not in a.option_strings and a.help != argparse.SUPPRESS]
  assert options
  for action in options:
    flag = action.option_strings[-1]
    assert flag in text, flag
    assert action.help and action.help.strip(), f"{name}: {flag} has no help text"
    if action.nargs != 0:  # it takes a value, so it has a default to state (flags are off)
      assert "(default" in action.help, f"{name}: {flag} does not state its default"
