"""jmp's own test suite, run unmodified against jmp_lite (issue 11, item 18).

The installed ``jmp`` wheel ships its tests (``jmp/_src/loss_scale_test.py``
and ``policy_test.py``). Each file is executed with its one import line,
``from jmp._src import <module> as jmp``, bound to a shim made of jmp_lite's
public names instead, and every upstream test becomes a pytest test here.

The tests that fail do so on purpose: each expected failure below is one
intended difference, listed in the README's "Differences from jmp", and is a
strict xfail, so it must keep failing (a pass means the difference is gone and
this list and the README must be updated).
"""

from __future__ import annotations

import importlib.util
import pathlib
import types
import unittest
import warnings

import numpy as np
import pytest

import jmp_lite
from jmp_lite._src import policy as policy_lib

UPSTREAM = {
    "loss_scale": "from jmp._src import loss_scale as jmp",
    "policy": "from jmp._src import policy as jmp",
}

# test id -> the intended difference (README "Differences from jmp").
EXPECTED_FAILURES = {
    # jmp_lite refuses a zero loss scale (every gradient would unscale to inf).
    "loss_scale:LossScaleTest.test_static_empty_trees_StaticLossScale":
        "StaticLossScale(0) is a ValueError: a scale must be finite and > 0",
    # min_loss_scale is a pytree leaf in jmp_lite (jmp drops it under jit).
    "loss_scale:LossScaleTest.test_dynamic_loss_scale_tree":
        "DynamicLossScale has three leaves: min_loss_scale survives jit",
    # Bad input raises ValueError/TypeError, never AssertionError (python -O).
    "loss_scale:LossScaleTest.test_select_tree_rejects_non_scalar":
        "select_tree raises ValueError, not AssertionError, for a non-scalar pred",
}


def _shim() -> types.ModuleType:
  shim = types.ModuleType("jmp_lite_as_jmp")
  for name in jmp_lite.__all__:
    setattr(shim, name, getattr(jmp_lite, name))
  # jmp's naming table, filled from jmp_lite's: the name str() writes first.
  groups: dict[type, list[str]] = {}
  for name, dtype in policy_lib.DTYPE_NAMES.items():
    groups.setdefault(dtype, []).append(name)
  shim.dtype_to_names = {}
  for dtype, names in groups.items():
    short = policy_lib.SHORT_NAMES[np.dtype(dtype)]
    shim.dtype_to_names[dtype] = (short, *(n for n in names if n != short))
  return shim


def _upstream_cases() -> list[tuple[str, unittest.TestCase]]:
  spec = importlib.util.find_spec("jmp")
  if spec is None or spec.origin is None:
    raise RuntimeError("the jmp wheel (a test extra) is not installed")
  src_dir = pathlib.Path(spec.origin).parent / "_src"
  cases = []
  for module, import_line in UPSTREAM.items():
    source = (src_dir / f"{module}_test.py").read_text()
    if import_line not in source:
      raise RuntimeError(f"{module}_test.py no longer has the line {import_line!r}")
    namespace = {"__name__": f"jmp_upstream_{module}_test", "__shim__": _shim()}
    exec(compile(source.replace(import_line, "jmp = __shim__"), str(src_dir / f"{module}_test.py"),
                 "exec"), namespace)
    loader = unittest.TestLoader()
    for value in namespace.values():
      if isinstance(value, type) and issubclass(value, unittest.TestCase):
        for case in loader.loadTestsFromTestCase(value):
          cases.append((f"{module}:{type(case).__name__}.{case._testMethodName}", case))
  return cases


CASES = _upstream_cases()


def test_upstream_suite_was_found():
  ids = [case_id for case_id, _ in CASES]
  assert len(ids) > 40, ids
  assert set(EXPECTED_FAILURES) <= set(ids), set(EXPECTED_FAILURES) - set(ids)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=case_id, marks=pytest.mark.xfail(
            strict=True, reason=EXPECTED_FAILURES[case_id])) if case_id in EXPECTED_FAILURES
        else pytest.param(case, id=case_id)
        for case_id, case in CASES
    ],
)
def test_jmp_upstream(case):
  result = unittest.TestResult()
  with warnings.catch_warnings():
    # As when jmp's suite runs on its own: its tests' numpy arithmetic warns
    # (3.0 ** 100 overflows float32), which this project's pytest config
    # would turn into errors.
    warnings.simplefilter("ignore", RuntimeWarning)
    case.run(result)
  problems = result.errors + result.failures
  assert not problems, problems[0][1]
  assert result.testsRun == 1 and not result.skipped, result.skipped
