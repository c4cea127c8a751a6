"""The public surface equals the documented list, and the README quickstart runs."""

import pathlib
import re

import jmp_lite

ROOT = pathlib.Path(__file__).resolve().parents[1]

DOCUMENTED = {
    # jmp-compatible names (drop-in for ``import jmp``).
    "Policy", "get_policy", "cast_to_full", "cast_to_half", "half_dtype",
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale",
    "all_finite", "select_tree",
    # The optax transformation.
    "LossScaleState", "dynamic_loss_scaling", "static_loss_scaling",
    "loss_scale_of", "skipped_steps_of",
    # The train step.
    "TrainState", "make_train_step",
    # Lean master weights.
    "apply_updates",
    # Autocast.
    "autocast", "AutocastLists", "Float8Recipe", "fp8_sensitivity", "Float8Sensitivity",
    "Float8SensitivityRow",
    # Diagnostics.
    "GradientReport", "LeafStats", "LintFinding", "LintFindings", "gradient_report",
    "nonfinite_paths", "precision_lint", "PrecisionReport", "precision_report",
}


def test_all_equals_documented_list():
  assert set(jmp_lite.__all__) == DOCUMENTED
  assert len(jmp_lite.__all__) == len(set(jmp_lite.__all__))
  for name in jmp_lite.__all__:
    assert hasattr(jmp_lite, name), name


def test_every_public_name_is_in_the_readme():
  readme = (ROOT / "README.md").read_text()
  missing = [name for name in jmp_lite.__all__ if f"`{name}" not in readme]
  assert not missing, f"undocumented in README.md: {missing}"


def test_jmp_names_are_a_subset():
  jmp = __import__("jmp")
  assert set(jmp.__all__) <= set(jmp_lite.__all__)


def test_version_and_py_typed():
  assert re.fullmatch(r"\d+\.\d+\.\d+", jmp_lite.__version__)
  assert (pathlib.Path(jmp_lite.__file__).parent / "py.typed").exists()


def test_readme_opens_with_two_setup_commands():
  readme = (ROOT / "README.md").read_text()
  block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
  assert len(block) == 2
  assert "examples/train_digits.py" in block[0] and "pip install" in block[0]
  assert "pytest" in block[1] and "pip install" in block[1]
  ci = (ROOT / ".ci" / "run").read_text()
  assert "python -m pytest" in ci and "'.[test]'" in ci


def test_readme_quickstart_runs():
  readme = (ROOT / "README.md").read_text()
  code = re.search(r"## Quickstart\n+```python\n(.*?)```", readme, re.S).group(1)
  namespace = {}
  exec(compile(code, "README-quickstart", "exec"), namespace)
  assert float(namespace["metrics"]["loss"]) < 0.05


def test_readme_loss_scaling_example_runs():
  # The example moved from the README to the loss-scaling guide.
  section = (ROOT / "docs" / "loss_scaling.md").read_text()
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  namespace = {}
  exec(compile(code, "README-loss-scaling", "exec"), namespace)
  state = namespace["new_opt_state"]
  assert float(jmp_lite.loss_scale_of(state)) == 2.0**14
  assert int(jmp_lite.skipped_steps_of(state)) == 1


def test_readme_lean_masters_example_runs():
  # The example moved from the README to the lean-masters guide.
  guide = (ROOT / "docs" / "masters.md").read_text()
  section = guide[guide.index("## In a plain optax loop"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  namespace = {}
  exec(compile(code, "README-lean-masters", "exec"), namespace)
  params, to_f32 = namespace["params"], namespace["to_f32"]
  assert params["w"].dtype == params["b"].dtype == namespace["comp"]["w"].dtype == "bfloat16"
  loss = namespace["loss_fn"](to_f32(params), namespace["x"], namespace["y"])
  assert float(loss) < 1e-3
