"""``python -m benchmarks.gpu_run``: the one command for a lent GPU, run here as its CPU smoke test.

The smoke run checks the plumbing (every item in order, results rewritten
after each, the budget, failures recorded); its timings are noise.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

import jmp_lite
from benchmarks import gpu_run

pytestmark = pytest.mark.xdist_group("test_gpu_run")

# Every warning is an error, except a compilation-cache entry read while another process
# writes it (conftest.py's cache; JAX then compiles the program itself, as on a miss).
WARNINGS_AS_ERRORS = "error,ignore:Error reading persistent compilation cache entry:UserWarning"
ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = [item.name for item in gpu_run.ITEMS]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_run")
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_run", "--smoke", "--out", str(out)],
                        cwd=ROOT, env=dict(os.environ, PYTHONWARNINGS=WARNINGS_AS_ERRORS),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  files = sorted(out.iterdir())
  assert [f.suffix for f in files] == [".json", ".md"] and files[0].stem.startswith("gpu-run-cpu-")
  return json.loads(files[0].read_text()), files[1].read_text()


@pytest.mark.slow
def test_smoke_runs_every_item_in_order_and_measures_each_pair(smoke):
  result, md = smoke
  assert result["meta"]["command"].startswith("python -m benchmarks.gpu_run --smoke --out ")
  assert [r["name"] for r in result["items"]] == NAMES
  quantized = "done" if hasattr(jmp_lite, "quantize_state") else "skipped"
  statuses = {r["name"]: r["status"] for r in result["items"]}
  assert statuses == {n: quantized if n == "quantized_state" else "done" for n in NAMES}
  for item, r in zip(gpu_run.ITEMS, result["items"]):
    if r["status"] != "done":
      continue
    assert sorted(r["variants"]) == sorted(item.variants)
    for key, _, _ in item.pairs:
      assert math.isfinite(r["ratios"][key]) and r["ratios"][key] > 0, (item.name, key)
    assert all(not b["meaningful"] for b in r["bars"])  # smoke timings are noise
  assert result["elapsed_s"] <= result["budget_s"]
  assert md.count("\n| ") >= len(NAMES) + 1 and "SMOKE (not meaningful)" in md


def test_the_budget_stops_new_items_and_the_results_say_why(tmp_path):
  assert gpu_run.main(["--smoke", "--budget", "0.001", "--out", str(tmp_path)]) == 0
  result = json.loads(next(tmp_path.glob("gpu-run-*.json")).read_text())
  assert [r["name"] for r in result["items"]] == NAMES
  assert all(r["status"] == "skipped" and r["reason"].startswith("budget: ")
             for r in result["items"]), result["items"]


def test_results_are_written_after_each_item_and_a_failure_does_not_stop_the_run(
    tmp_path, monkeypatch):
  written = []
  monkeypatch.setattr(gpu_run.report, "write",
                      lambda result, stem, text: written.append(
                          [r["status"] for r in result["items"]]))

  def fake(item, settings, on_gpu):
    if item.name == NAMES[1]:
      raise RuntimeError("out of memory")
    return dict(status="done", ratios={"r": 1.0}, bars=[])

  monkeypatch.setattr(gpu_run, "run_item", fake)
  assert gpu_run.main(["--smoke", "--out", str(tmp_path)]) == 1  # a failed item: exit status 1
  expected = ["done", "failed"] + ["done"] * (len(NAMES) - 2)
  assert written == [expected[:k] for k in range(1, len(NAMES) + 1)]


def test_the_quantized_state_item_times_int8_and_int4_against_adamw():
  item = next(i for i in gpu_run.ITEMS if i.name == "quantized_state")
  r = gpu_run.run_item(item, gpu_run.SMOKE_SETTINGS, on_gpu=False)
  assert r["status"] == "done"
  assert sorted(r["variants"]) == ["adamw", "adamw_int4", "adamw_int8"]
  for key in ("int8_vs_adamw", "int4_vs_adamw"):
    assert math.isfinite(r["ratios"][key]) and r["ratios"][key] > 0
  # The coded variants persist less than adamw's float32 moments.
  state_bytes = {n: v["memory_bytes"]["argument"] for n, v in r["variants"].items()}
  assert state_bytes["adamw_int4"] < state_bytes["adamw_int8"] < state_bytes["adamw"]


def test_without_quantize_state_the_item_is_skipped_with_the_reason(monkeypatch):
  monkeypatch.delattr(jmp_lite, "quantize_state", raising=False)
  item = next(i for i in gpu_run.ITEMS if i.name == "quantized_state")
  r = gpu_run.run_item(item, gpu_run.SMOKE_SETTINGS, on_gpu=False)
  assert r == dict(status="skipped",
                   reason="this jmp_lite has no jmp.quantize_state (the int8 optimizer state)")
