"""The benchmark suite's CI check: ``python -m benchmarks.run --smoke`` end to end.

The bars themselves are checked by the benchmark, not here: smoke-sized
timings are noise, so a smoke run prints its bars as not meaningful (never
FAIL). This test checks that the command runs, prints the table and the bar
lines, writes consistent JSON, Markdown and PNG files, and documents every
option in ``--help``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE_VARIANTS = ("fp32", "bf16", "f16_dynamic", "f16_noscale", "jmp_dynamic", "flax_dynamic")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  env = dict(os.environ, PYTHONWARNINGS="error")
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(out)],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  files = sorted(out.iterdir())
  return proc, out, files


def test_writes_json_markdown_and_png(smoke):
  _, _, files = smoke
  suffixes = sorted(f.suffix for f in files)
  assert suffixes == [".json", ".md", ".png"], files
  stems = {f.stem for f in files}
  assert len(stems) == 1 and next(iter(stems)).startswith("cpu-"), stems
  png = next(f for f in files if f.suffix == ".png")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_is_complete_and_consistent(smoke):
  _, out, files = smoke
  result = json.loads(next(f for f in files if f.suffix == ".json").read_text())
  assert result["meta"]["smoke"] is True
  assert result["meta"]["platform"] == "cpu"
  assert result["meta"]["command"].startswith("python -m benchmarks.run --smoke")
  (model,) = result["models"]
  assert model["model"] == "mlp"
  assert tuple(model["variants"]) == SMOKE_VARIANTS
  for name, v in model["variants"].items():
    st = v["step_s"]
    assert len(st["samples"]) == model["repeats"] == 3
    assert 0 < st["min"] <= st["median"] <= st["max"], (name, st)
    assert math.isclose(v["examples_per_s"], model["examples_per_step"] / st["median"])
    assert v["compile_s"] > 0 and v["lower_s"] > 0
    mem = v["memory_bytes"]
    assert mem["argument"] > 0 and mem["output"] > 0 and mem["temp"] >= 0
    assert mem["total"] == mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    assert v["flops"] > 0 and v["tflops_per_s"] > 0
    assert math.isfinite(v["loss_after_warmup"]) and v["loss_after_warmup"] > 0
    # The state is donated: every variant's outputs alias its inputs.
    assert mem["alias"] > 0, name
  variants = model["variants"]
  assert variants["fp32"]["loss_scale_before"] is None
  for name in ("f16_dynamic", "jmp_dynamic", "flax_dynamic"):
    assert variants[name]["loss_scale_before"] == result["meta"]["init_scale"]
    assert variants[name]["skipped_during_timing"] is False
  # The same model: every variant does the same matmul work, within casts/optimizer.
  flops = [v["flops"] for v in variants.values()]
  assert max(flops) / min(flops) < 1.5, flops
  ratios = model["ratios"]
  med = {n: v["step_s"]["median"] for n, v in variants.items()}
  assert math.isclose(ratios["overhead"], med["f16_dynamic"] / med["f16_noscale"])
  assert math.isclose(ratios["vs_jmp"], med["f16_dynamic"] / med["jmp_dynamic"])
  assert math.isclose(ratios["vs_flax"], med["f16_dynamic"] / med["flax_dynamic"])
  bars = {b["bar"]: b for b in result["bars"]}
  assert set(bars) == {"overhead", "vs_jmp", "vs_flax"}
  for key, limit in (("overhead", 1.03), ("vs_jmp", 1.0), ("vs_flax", 1.0)):
    assert bars[key]["limit"] == limit
    assert bars[key]["value"] == ratios[key]
    assert bars[key]["passed"] == (ratios[key] <= limit)
    assert bars[key]["meaningful"] is False
  assert result["all_bars_pass"] is None


def test_prints_the_table_and_the_bars(smoke):
  proc, out, files = smoke
  md = next(f for f in files if f.suffix == ".md").read_text()
  assert md in proc.stdout
  header = "| variant | step ms | examples/s | time vs fp32 |"
  assert header in proc.stdout
  table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
  for label in ("fp32 (optax)", "jmp_lite f16 + dynamic scaling", "Flax DynamicScale f16"):
    assert any(line.startswith(f"| {label} |") for line in table), label
  bar_lines = [line for line in proc.stdout.splitlines() if "(limit " in line]
  assert len(bar_lines) == 3
  assert all(line.startswith("SMOKE (not meaningful) ") for line in bar_lines), bar_lines
  assert "FAIL" not in proc.stdout and "PASS" not in proc.stdout
  assert "| SMOKE (not meaningful) |" in md
  assert f"wrote {out}" in proc.stdout


def _run(module, *args):
  return subprocess.run(
      [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
  )


@pytest.mark.parametrize(
    "module, args, allowed",
    [
        ("benchmarks.run", ("--smoke", "--variants", "fp64"), "f16_dynamic"),
        ("benchmarks.run", ("--smoke", "--steps", "0"), ">= 1"),
        ("benchmarks.overhead_study", ("--model", "fp64"), "mlp"),
    ],
)
def test_bad_arguments_are_refused(module, args, allowed):
  proc = _run(module, *args)
  assert proc.returncode == 2
  assert args[-1] in proc.stderr and allowed in proc.stderr, proc.stderr


def _options(help_text):
  """``{option: its help text}`` from an argparse ``--help`` output."""
  options, current = {}, None
  for line in help_text.split("options:")[1].splitlines():
    if line.startswith("  -"):
      words = line.split()
      current = next(w.rstrip(",") for w in words if w.startswith("--"))
      # The help starts on the option's line after two spaces, or on the next line.
      head = line[2:].split("  ", 1)
      options[current] = head[1].strip() if len(head) > 1 else ""
    elif line.startswith("    ") and current:
      options[current] = (options[current] + " " + line.strip()).strip()
    else:
      current = None
  return options


@pytest.mark.parametrize("module", ["benchmarks.run", "benchmarks.overhead_study"])
def test_help_documents_every_option_and_its_default(module):
  proc = _run(module, "--help")
  assert proc.returncode == 0, proc.stderr
  options = _options(proc.stdout)
  usage = proc.stdout.split("options:")[0]
  used = {w.strip("[]") for w in usage.split() if w.startswith("[--")}
  assert used and used <= set(options), (used, options)
  for option, text in options.items():
    assert text, f"{option} has no help text"
  for option in ("--steps", "--sample-seconds", "--device") + (
      ("--variants", "--warmup") if module == "benchmarks.run" else ()
  ):
    assert "(default: " in options[option], (option, options[option])
  assert "--policy" not in proc.stdout
