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
    "TrainState", "make_train_step", "make_eval_step", "NothingInHalfWarning", "HalfSumWarning",
    # Lean master weights.
    "apply_updates",
    # Quantised optimizer state.
    "quantize_state", "QuantizedArray", "QuantizedState",
    # Autocast.
    "autocast", "AutocastLists", "Float8Recipe", "fp8_sensitivity", "Float8Sensitivity",
    "Float8SensitivityRow",
    # Diagnostics.
    "GradientReport", "LeafStats", "LintFinding", "LintFindings", "gradient_report",
    "nonfinite_paths", "precision_lint", "PrecisionReport", "precision_report",
    "memory_ledger", "MemoryLedger", "LedgerRow",
    "compile_for_gpu", "GpuCompileReport",
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
  # CI installs the test extra (and may add others, such as `gpu`) and runs the same pytest.
  assert "python -m pytest" in ci and re.search(r"'\.\[test[],]", ci), ci


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


# The floors of docs/architecture.md ("The house"): a module imports from its own
# package or from a lower floor, never from a higher one.
FLOORS = {
    "tree_utils": 1, "checks": 1, "filtering": 1, "jaxpr_utils": 1,
    "policy": 2, "masters": 2, "scaling": 2,
    "fp8": 3, "optim": 3,
    "autocast": 4,
    "step": 5,
    "diagnostics": 6,
}


def _src_imports():
  """(importing room, imported room) for every import between jmp_lite._src modules."""
  import ast  # pylint: disable=import-outside-toplevel
  src = pathlib.Path(jmp_lite.__file__).parent / "_src"
  modules = {p.relative_to(src).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
             for p in src.rglob("*.py")}
  pairs = []
  for path in src.rglob("*.py"):
    room = path.relative_to(src).parts[0].removesuffix(".py")
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jmp_lite._src"):
        base = node.module.removeprefix("jmp_lite._src").lstrip(".")
        for alias in node.names:
          name = f"{base}.{alias.name}" if base else alias.name
          target = name if name in modules else base
          pairs.append((path.name, room, target.split(".")[0]))
  return modules, pairs


def test_every_module_has_a_floor_and_imports_only_downward():
  modules, pairs = _src_imports()
  rooms = {m.split(".")[0] for m in modules if m != "__init__"}
  assert rooms == set(FLOORS), "place new rooms in FLOORS and docs/architecture.md"
  assert pairs
  upward = [(f, room, target) for f, room, target in pairs
            if room != target and FLOORS[target] >= FLOORS[room]]
  assert not upward, upward


def test_architecture_doc_shows_every_room():
  doc = (ROOT / "docs" / "architecture.md").read_text()
  house = re.search(r"```\n(floor 6.*?)```", doc, re.S).group(1)
  for room, floor in FLOORS.items():
    line = next(l for l in house.splitlines() if l.startswith(f"floor {floor} "))
    assert re.search(rf"\b{room}\b", line), (room, line)
