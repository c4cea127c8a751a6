"""The benchmark suite's CI check: the ``--smoke`` runs of ``benchmarks.run``,
``benchmarks.sweep`` and ``benchmarks.autocast`` end to end.

The bars themselves are checked by the benchmarks, not here: smoke-sized
timings are noise, so a smoke run prints its bars as not meaningful (never
FAIL). These tests check that the commands run, print their tables and bar
lines, and write consistent JSON, Markdown and PNG files
(``tests/test_cli_help.py`` checks their ``--help``).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import autocast
from benchmarks import call_overhead
from benchmarks import bars as bars_lib
from benchmarks import masters
from benchmarks import measure
from benchmarks import models
from benchmarks import residuals
from benchmarks import report
from benchmarks import run
from benchmarks import sweep
from benchmarks import variants as variants_lib
import jmp_lite as jmp

# Its module-scoped fixtures run once: all its tests on one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("test_benchmarks")

# Every warning is an error, except a compilation-cache entry read while another process
# writes it (conftest.py's cache; JAX then compiles the program itself, as on a miss).
WARNINGS_AS_ERRORS = "error,ignore:Error reading persistent compilation cache entry:UserWarning"
ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOKE_VARIANTS = ("fp32", "bf16", "f16_dynamic", "f16_noscale", "jmp_dynamic", "flax_dynamic")


def _smoke_run(module, out):
  proc = subprocess.run(
      [sys.executable, "-m", module, "--smoke", "--out", str(out)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONWARNINGS=WARNINGS_AS_ERRORS),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc, out, sorted(out.iterdir())


def _smoke_result(module, out):
  """Runs ``python -m module --smoke``: the run, its files and its JSON result (name and command checked)."""
  proc, _, files = _smoke_run(module, out)
  assert [f.suffix for f in files] == [".json", ".md"]
  name = module.split(".")[-1].replace("_", "-")
  assert files[0].stem.startswith(f"{name}-cpu-")
  result = json.loads(files[0].read_text())
  assert result["meta"]["command"] == f"python -m {module} --smoke --out {out}"
  return proc, files, result


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  return _smoke_run("benchmarks.run", tmp_path_factory.mktemp("bench"))


@pytest.fixture(scope="module")
def sweep_smoke(tmp_path_factory):
  return _smoke_run("benchmarks.sweep", tmp_path_factory.mktemp("sweep"))


def _assert_json_md_png(files, prefix):
  suffixes = sorted(f.suffix for f in files)
  assert suffixes == [".json", ".md", ".png"], files
  stems = {f.stem for f in files}
  assert len(stems) == 1 and next(iter(stems)).startswith(prefix), stems
  png = next(f for f in files if f.suffix == ".png")
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  return json.loads(next(f for f in files if f.suffix == ".json").read_text())


def _assert_smoke_output(proc, files, bar_count):
  md = next(f for f in files if f.suffix == ".md").read_text()
  assert md in proc.stdout
  bar_lines = [line for line in proc.stdout.splitlines() if "(limit " in line]
  assert len(bar_lines) == bar_count
  assert all(line.startswith(report.SMOKE_STATUS + " ") for line in bar_lines), bar_lines
  assert "FAIL" not in proc.stdout and "PASS" not in proc.stdout
  return md


@pytest.mark.slow
def test_json_is_complete_and_consistent(smoke):
  _, _, files = smoke
  result = _assert_json_md_png(files, "cpu-")
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
  temp = {n: v["memory_bytes"]["temp"] for n, v in variants.items()}
  assert ratios["temp_overhead"] == temp["f16_dynamic"] / temp["f16_noscale"]
  bars = {b["bar"]: b for b in result["bars"]}
  assert set(bars) == {"overhead", "vs_jmp", "vs_flax", "temp_overhead"}
  limits = (("overhead", 1.03), ("vs_jmp", 1.0), ("vs_flax", 1.0), ("temp_overhead", 1.05))
  for key, limit in limits:
    assert bars[key]["limit"] == limit
    assert bars[key]["value"] == ratios[key]
    assert bars[key]["passed"] == (ratios[key] <= limit)
    assert bars[key]["meaningful"] is False
  assert result["all_bars_pass"] is None


@pytest.mark.slow
def test_prints_the_table_and_the_bars(smoke):
  proc, out, files = smoke
  md = _assert_smoke_output(proc, files, bar_count=4)
  header = "| variant | step ms | examples/s | time vs fp32 |"
  assert header in proc.stdout
  table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
  for label in ("fp32 (optax)", "jmp_lite f16 + dynamic scaling", "Flax DynamicScale f16"):
    assert any(line.startswith(f"| {label} |") for line in table), label
  assert f"| {report.SMOKE_STATUS} |" in md
  assert f"wrote {out}" in proc.stdout


def _parse(module, argv):
  """Parses ``argv`` as ``python -m benchmarks.<module>`` would, in this process."""
  parser = module.build_parser()
  if hasattr(module, "parse_args"):
    return module.parse_args(parser, list(argv))
  return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "module, args, allowed",
    [
        (run, ("--smoke", "--variants", "fp64"), "f16_dynamic"),
        (run, ("--smoke", "--steps", "0"), ">= 1"),
        (run, ("--sample-seconds", "-1"), "> 0"),
        (sweep, ("--sizes", "huge"), "wide"),
        (sweep, ("--leaves", "50,0"), ">= 1"),
    ],
)
def test_bad_arguments_are_refused(module, args, allowed, capsys):
  with pytest.raises(SystemExit) as e:
    _parse(module, args)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert args[-1] in err and allowed in err, err


def test_smoke_defaults():
  args = _parse(run, ["--smoke"])
  assert args.models == ["mlp"] and args.steps == 3 and "fp32_highest" not in args.names
  args = _parse(sweep, ["--smoke", "--variants", "flax_dynamic"])
  assert args.leaves == list(sweep.SMOKE_LEAVES) and args.repeats == 2
  assert args.names == ["f16_noscale", "flax_dynamic"]  # the baseline always runs
  args = _parse(sweep, ["--leaves", "1000,50"])
  assert args.leaves == [50, 1000] and args.sizes == ["small", "wide"]


@pytest.mark.slow
def test_sweep_json_is_complete_and_consistent(sweep_smoke):
  _, _, files = sweep_smoke
  result = _assert_json_md_png(files, "sweep-cpu-")
  assert result["meta"]["smoke"] is True
  assert result["meta"]["command"].startswith("python -m benchmarks.sweep --smoke")
  cases = [(c["size"], c["leaf_size"], c["leaves"]) for c in result["cases"]]
  assert cases == [("small", 16, 3), ("small", 16, 10), ("wide", 4096, 3), ("wide", 4096, 10)]
  for c in result["cases"]:
    assert tuple(c["variants"]) == sweep.VARIANTS
    base = c["variants"]["f16_noscale"]
    for name, v in c["variants"].items():
      assert len(v["step_s"]["samples"]) == c["repeats"] == 2
      assert v["lower_s"] > 0 and v["compile_s"] > 0
      assert v["memory_bytes"]["temp"] > 0
      assert math.isfinite(v["loss_after_warmup"])
      if name == "f16_noscale":
        assert v["loss_scale_before"] is None
        continue
      assert v["loss_scale_before"] == 2.0**15 and v["skipped_during_timing"] is False
      r = c["ratios"][name]
      assert r["step"] == (
          statistics.median(v["step_s"]["samples"]) / statistics.median(base["step_s"]["samples"])
      )
      assert r["compile"] == v["compile_s"] / base["compile_s"]
      assert r["lower"] == v["lower_s"] / base["lower_s"]
      assert r["temp"] == v["memory_bytes"]["temp"] / base["memory_bytes"]["temp"]
    g = c["gradient_report"]
    assert g["first_s"] > 0 and g["second_s"] > 0
  # The targets are set at 200, 300 and 1000 leaves: none at smoke sizes.
  assert result["bars"] == [] and result["all_bars_pass"] is None


@pytest.mark.slow
def test_sweep_prints_its_tables(sweep_smoke):
  proc, out, files = sweep_smoke
  md = _assert_smoke_output(proc, files, bar_count=0)
  assert "| size | leaves | variant | step ms | step x |" in md
  assert "| wide | 10 | f16_dynamic |" in md
  assert "| size | leaves | gradient_report first call s | second call s |" in md
  assert f"wrote {out}" in proc.stdout


def _case(size, leaves, step, compile_, report_s):
  return dict(
      size=size,
      leaves=leaves,
      ratios={"f16_dynamic": dict(step=step, compile=compile_)},
      gradient_report=dict(first_s=report_s, second_s=0.5),
  )


@pytest.mark.parametrize("meaningful", [True, False])
def test_sweep_checks_its_targets_where_their_cases_ran(meaningful):
  cases = [
      _case("wide", 200, 1.04, 9.0, 1.0),  # step passes; compile is not a target here
      _case("small", 300, 2.0, 1.6, 1.0),  # compile fails
      _case("small", 1000, 2.0, 1.4, 4.6),  # compile passes; report 5.1 s fails
      _case("wide", 1000, 2.0, 2.0, 4.4),  # report 4.9 s passes
      _case("small", 50, 9.0, 9.0, 9.0),  # no target
  ]
  bars = sweep.check_bars(cases, meaningful)
  got = [(b["bar"], b["case"], b["value"], b["passed"]) for b in bars]
  assert got == [
      ("step", "wide x 200", 1.04, True),
      ("compile", "small x 300", 1.6, False),
      ("compile", "small x 1000", 1.4, True),
      ("gradient_report", "small x 1000", 5.1, False),
      ("gradient_report", "wide x 1000", 4.9, True),
  ]
  assert [b["limit"] for b in bars] == [1.05, 1.5, 1.5, 5.0, 5.0]
  statuses = {report.bar_status(b) for b in bars}
  assert statuses == ({"PASS", "FAIL"} if meaningful else {report.SMOKE_STATUS})


def test_f16_autocast_runs_only_when_named():
  assert "f16_autocast" not in _parse(run, ["--smoke"]).names
  assert _parse(run, ["--smoke", "--variants", "f16_autocast,f16_dynamic"]).names == [
      "f16_dynamic", "f16_autocast"]


class _NoProgress:
  def set_postfix_str(self, text):
    pass

  def update(self, n):
    pass


def test_f16_autocast_variant_keeps_softmax_in_float32_and_is_compared_to_f16_dynamic():
  problem = models.build_problem("transformer", "smoke")
  sig = {}
  for name in ("f16_dynamic", "f16_autocast"):
    variant = variants_lib.make_variant(name, problem)
    sig[name] = autocast.dtype_signature(variant.fn, variant.init(), problem.batch)
  exp32 = ("exp", ("float32",))
  # Both take the loss's softmax in float32; only autocast takes attention's too.
  assert sig["f16_autocast"][exp32] > sig["f16_dynamic"][exp32] >= 1
  result = measure.bench_model(
      models.build_problem("mlp", "smoke"), ["f16_dynamic", "f16_autocast"], repeats=2, warmup=1, target_s=1e-9,
      on_gpu=False, peak_tflops=None, peaks={}, progress=_NoProgress(), meaningful=False)
  samples = {n: v["step_s"]["samples"] for n, v in result["variants"].items()}
  assert result["ratios"]["autocast_vs_dynamic"] == (
      statistics.median(samples["f16_autocast"]) / statistics.median(samples["f16_dynamic"]))
  assert result["variants"]["f16_autocast"]["skipped_during_timing"] is False
  assert result["variants"]["f16_autocast"]["label"] == variants_lib.LABELS["f16_autocast"]


def test_fp8_variant_runs_only_when_named_and_is_compared_to_bf16_autocast():
  assert not {"bf16_autocast", "bf16_fp8"} & set(_parse(run, ["--smoke"]).names)
  problem = models.build_problem("mlp", "smoke")
  variant = variants_lib.make_variant("bf16_fp8", problem)
  report_ = jmp.precision_report(variant.fn, variant.init(), problem.batch)
  assert report_.count("matmul") == report_.count("matmul", "float8_e4m3fn") + report_.count(
      "matmul", "float8_e4m3fn+float8_e5m2") > 0
  result = measure.bench_model(
      problem, ["bf16_autocast", "bf16_fp8"], repeats=2, warmup=1, target_s=1e-9,
      on_gpu=False, peak_tflops=None, peaks={}, progress=_NoProgress(), meaningful=False)
  samples = {n: v["step_s"]["samples"] for n, v in result["variants"].items()}
  assert result["ratios"]["fp8_vs_bf16_autocast"] == (
      statistics.median(samples["bf16_fp8"]) / statistics.median(samples["bf16_autocast"]))
  assert not any("fp8" in b["bar"] for b in result["bars"])  # emulated on CPU: no bar


def test_fp8_speedup_is_a_gpu_bar_on_the_transformers_only():
  ratios = {"fp8_vs_bf16_autocast": 0.8}
  assert bars_lib.check_bars("transformer", ratios, on_gpu=False) == []
  assert bars_lib.check_bars("mlp", ratios, on_gpu=True) == []
  (b,) = bars_lib.check_bars("transformer", ratios, on_gpu=True)
  assert (b["bar"], b["scope"], b["passed"]) == ("fp8_vs_bf16_autocast", "gpu", False)
  assert b["limit"] == pytest.approx(1 / 1.3)
  (b,) = bars_lib.check_bars("deep_transformer", {"fp8_vs_bf16_autocast": 0.75}, on_gpu=True)
  assert b["passed"]


def test_gpu_bars_add_the_skip_overhead_and_the_host_sync_check():
  ratios = {"overhead": 1.025, "dispatch_fraction": 0.97, "dispatch_ahead": 7.0, "vs_flax": 0.9}
  cpu = {(b["bar"], b["limit"]) for b in bars_lib.check_bars("mlp", ratios, on_gpu=False)}
  assert cpu == {("overhead", 1.03), ("vs_flax", 1.0)}
  gpu = {(b["bar"], b["limit"], b["scope"], b["passed"])
         for b in bars_lib.check_bars("mlp", ratios, on_gpu=True)}
  assert gpu == {("overhead", 1.03, "cpu", True), ("vs_flax", 1.0, "cpu", True),
                 ("overhead", 1.02, "gpu", False), ("dispatch_ahead", 2.0, "gpu", False)}


def test_dispatch_fraction_is_measured_per_variant_where_the_gpu_bars_apply():
  # on_gpu=True on the CPU: the code path a GPU run takes, at smoke size.
  result = measure.bench_model(
      models.build_problem("mlp", "smoke"), ["f16_dynamic", "f16_noscale"], repeats=2, warmup=1,
      target_s=1e-9, on_gpu=True, peak_tflops=None, peaks={}, progress=_NoProgress(),
      meaningful=False)
  for v in result["variants"].values():
    d = v["dispatch"]
    assert d["steps"] == measure.DISPATCH_STEPS and 0 < d["dispatch_s"] <= d["total_s"]
    assert d["fraction"] == d["dispatch_s"] / d["total_s"]
  d = {n: v["dispatch"] for n, v in result["variants"].items()}
  assert result["ratios"]["dispatch_fraction"] == d["f16_dynamic"]["fraction"]
  assert result["ratios"]["dispatch_ahead"] == pytest.approx(
      measure.steps_ahead(d["f16_noscale"]) / measure.steps_ahead(d["f16_dynamic"]))
  assert {b["bar"] for b in result["bars"] if b["scope"] == "gpu"} == {"overhead", "dispatch_ahead"}
  assert result["variants"]["f16_dynamic"]["skipped_during_timing"] is False


def test_autocast_benchmark_compares_programs_with_the_same_dtypes():
  policy = jmp.get_policy("mixed_float16")
  params = policy.cast_to_compute(autocast.init(jax.random.key(0), 16, 1, 8))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 9))
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  natural = lambda p, b: autocast.loss(p, b, heads=2, c=autocast.Casts(hand=False))  # noqa: E731
  hand = lambda p, b: autocast.loss(p, b, heads=2, c=autocast.Casts(hand=True))  # noqa: E731
  autocast_sig = autocast.dtype_signature(jmp.autocast(natural, jnp.float16), params, batch)
  assert autocast_sig == autocast.dtype_signature(hand, params, batch)
  assert autocast_sig != autocast.dtype_signature(natural, params, batch)  # autocast changed it
  assert ("exp", ("float32",)) in autocast_sig and ("dot_general", ("float16",)) in autocast_sig


@pytest.mark.slow
def test_autocast_benchmark_smoke(tmp_path):
  out = tmp_path
  proc, files, result = _smoke_result("benchmarks.autocast", out)
  step = result["step"]
  assert step["same_dtypes"] is True
  samples = {k: v["step_s"]["samples"] for k, v in step["variants"].items()}
  assert list(samples) == ["autocast", "hand"] and all(len(s) == 3 for s in samples.values())
  assert step["ratio"] == measure.compare(samples["autocast"], samples["hand"])
  assert all(v["skipped_during_timing"] is False for v in step["variants"].values())
  rows = [(r["model"], r["trace"]) for r in result["trace"]]
  assert rows == [("functional", "forward"), ("functional", "grad"), ("flax", "forward"),
                  ("flax", "grad")]
  for r in result["trace"]:
    assert r["ratio"]["median"] == r["autocast_s"] / r["plain_s"]
  bars = [(b["bar"], b["model"], b["limit"], b["meaningful"]) for b in result["bars"]]
  assert bars == [("step", "functional", 1.05, False), ("trace_grad", "functional", 2.0, False),
                  ("trace_grad", "flax", 2.0, False)]
  assert result["all_bars_pass"] is None
  _assert_smoke_output(proc, files, bar_count=3)
  assert proc.stdout.startswith("functional Transformer 1x d_model 16")
  assert f"results will be written to {out}" in proc.stdout.splitlines()[0]


def test_time_once_checks_the_last_output_of_each_sample():
  step = lambda s, _: (s + 1, {"grads_finite": s < 3})  # noqa: E731  skips from the 4th call
  live = measure.Live("v", step, jnp.zeros((), jnp.int32), [], {},
                      check=masters._not_skipped("bf16_kahan"))  # pylint: disable=protected-access
  assert measure.time_once(live, None, 2) > 0 and int(live.state) == 2
  with pytest.raises(RuntimeError, match="bf16_kahan: a step was skipped while timing"):
    measure.time_once(live, None, 2)
  assert len(live.cpu_times) == 2


# --- benchmarks.call_overhead ----------------------------------------------------------------


def test_call_overhead_variants_train_the_tiny_model_alike():
  args = call_overhead.build_parser().parse_args(["--smoke"])
  args.repeats, args.sample_seconds = 2, 0.001
  result = call_overhead.run_model("tiny", args)
  assert set(result["per_call_us"]) == {
      "jax_jit", "jmp_lite", "jmp_same_jit", "jax_jit_dls", "jmp_lite_dls"}
  assert all(t > 0 for t in result["per_call_us"].values())
  # The same model, batch and sgd from the same start: the same losses, call after call.
  assert result["max_relative_loss_difference"] <= 1e-6


def test_call_overhead_bars_are_the_ratios_of_per_call_times():
  results = [dict(model="tiny", per_call_us=dict(jax_jit=20.0, jmp_lite=22.0, jmp_same_jit=21.0,
                                                 jax_jit_dls=25.0, jmp_lite_dls=30.0)),
             dict(model="vit", per_call_us=dict(flax=100.0, jmp_lite=103.0))]
  reported, checked = call_overhead.ratios_and_bars(results, meaningful=True)
  assert [(r["model"], r["value"]) for r in reported] == [("vit", 103.0 / 100.0)]
  values = {b["bar"]: (b["value"], b["passed"]) for b in checked}
  assert values == {"vs_jax_jit": (22.0 / 20.0, True), "vs_jax_jit_dls": (30.0 / 25.0, False),
                    "python_side": (22.0 / 21.0, True)}


@pytest.mark.slow
def test_call_overhead_smoke(tmp_path):
  proc, files, result = _smoke_result("benchmarks.call_overhead", tmp_path)
  assert [r["model"] for r in result["results"]] == list(call_overhead.MODELS)
  assert {b["bar"] for b in result["bars"]} == {"vs_jax_jit", "vs_jax_jit_dls", "python_side"}
  assert all(not b["meaningful"] for b in result["bars"])
  assert all(r["max_relative_loss_difference"] <= 1e-5 for r in result["results"])
  md = files[1].read_text()
  assert md in proc.stdout and "| jmp_lite / flax | bilstm |" in md
  assert report.SMOKE_STATUS in proc.stdout


# --- benchmarks.residuals (its measure is tested in test_bench_residuals.py) ---------------------


@pytest.mark.slow
def test_residuals_smoke(tmp_path):
  proc, files, result = _smoke_result("benchmarks.residuals", tmp_path)
  rows = {r["model"]: r["variants"] for r in result["rows"]}
  assert list(rows) == list(residuals.MODELS) and set(rows["vit"]) == set(residuals.VARIANTS)
  assert files[1].read_text() in proc.stdout  # the Markdown report, printed


def test_residuals_help_lists_the_variants_and_models(capsys):
  with pytest.raises(SystemExit):
    residuals.build_parser().parse_args(["--help"])
  text = capsys.readouterr().out
  assert "(default: all)" in text and all(n in text for n in (*residuals.VARIANTS,
                                                               *residuals.MODELS))
