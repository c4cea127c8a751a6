"""The examples run end to end (``--smoke``, as CI does) and digits reaches fp32 accuracy.

They write to the untracked ``out/`` by default, and say what they are about to
do before they do it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODE_ROWS = ("| fp32 ", "| bf16 ", "| f16 ")
SCRIPTS = ("train_digits", "char_lm", "transformer_lm", "underflow", "weight_updates")


def _env() -> dict[str, str]:
  # Import this checkout's jmp_lite, whatever the environment has installed.
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  return {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _run_smoke(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, str(Path("examples") / script), "--smoke", "--out", str(out), *args],
      cwd=ROOT,
      env=_env(),
      capture_output=True,
      text=True,
      timeout=300,
  )


def _smoke_rows(script: str, name: str, out: Path) -> tuple[dict, dict]:
  """Runs ``script --smoke --no-progress``: its JSON payload and its results by mode."""
  proc = _run_smoke(script, out, "--no-progress")
  assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
  payload = json.loads((out / f"{name}.json").read_text())
  assert payload["config"]["smoke"] is True
  return payload, {r["mode"]: r for r in payload["results"]}


def _import_example(monkeypatch, name: str):
  """The example script ``name`` as a fresh module (with a fresh ``_common``)."""
  monkeypatch.syspath_prepend(str(EXAMPLES))
  for mod in (name, "_common", "char_lm"):
    monkeypatch.delitem(sys.modules, mod, raising=False)
  return importlib.import_module(name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, name, header",
    [
        # train_digits runs below, by default and at 5 steps per mode.
        ("char_lm.py", "char_lm", "| mode | policy             | valid ppl/byte |"),
    ],
    ids=["char_lm"],
)
def test_example_smoke_prints_table_and_writes_results(tmp_path, script, name, header):
  proc = _run_smoke(script, tmp_path)
  assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
  assert header in proc.stdout, proc.stdout
  for row in MODE_ROWS:
    assert row in proc.stdout, proc.stdout
  assert "Traceback" not in proc.stderr
  payload = json.loads((tmp_path / f"{name}.json").read_text())
  assert [r["mode"] for r in payload["results"]] == ["fp32", "bf16", "f16"]
  assert payload["config"]["smoke"] is True
  f16 = payload["results"][2]
  assert f16["final_scale"] >= 2.0**14  # the dynamic scale is live, not the no-op 1.0
  assert payload["results"][0]["final_scale"] == 1.0
  assert header in (tmp_path / f"{name}.md").read_text()


@pytest.mark.slow
def test_transformer_lm_smoke_trains_four_ways(tmp_path):
  proc = _run_smoke("transformer_lm.py", tmp_path)
  assert proc.returncode == 0, f"transformer_lm.py failed:\n{proc.stdout}\n{proc.stderr}"
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("stdlib source:")
  assert lines[1] == f"results will be written to {tmp_path}"
  assert lines[2].startswith("training fp32")
  modes = ["fp32", "mixed_f16", "autocast_f16", "autocast_bf16"]
  for mode in modes:
    assert f"| {mode} " in proc.stdout, proc.stdout
  payload = json.loads((tmp_path / "transformer_lm.json").read_text())
  results = payload["results"]
  assert payload["config"]["smoke"] is True
  assert [r["mode"] for r in results] == modes
  assert [r["autocast"] for r in results] == [False, False, True, True]
  assert not any(r["fp8"] for r in results)
  assert all(np.isfinite(r["valid_bpb"]) and r["skipped"] == 0 for r in results)
  assert results[2]["final_scale"] >= 2.0**14 and results[3]["final_scale"] == 1.0
  png = (tmp_path / "transformer_lm.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.slow
def test_transformer_lm_smoke_lean_state_modes_through_a_wsd_cooldown(tmp_path):
  proc = _run_smoke("transformer_lm.py", tmp_path, "--no-progress", "--modes", "fp32",
                    "bf16_lean_int8", "bf16_lean_float8", "bf16_lean_int4", "--schedule", "wsd")
  assert proc.returncode == 0, f"transformer_lm.py failed:\n{proc.stdout}\n{proc.stderr}"
  results = json.loads((tmp_path / "transformer_lm_lean_state_wsd.json").read_text())["results"]
  assert [r["mode"] for r in results] == ["fp32", "bf16_lean_int8", "bf16_lean_float8",
                                          "bf16_lean_int4"]
  assert all(np.isfinite(r["valid_bpb"]) and r["skipped"] == 0 for r in results)
  bpb = [r["valid_bpb"] for r in results]
  assert max(bpb) < 1.01 * bpb[0]  # a few steps from the same weights: coded state tracks fp32
  # 8 smoke steps: the decay is the last one, validated before it and after it (the final bpb).
  for r in results:
    assert len(r["decay_bpb"]) == 2 and r["decay_bpb"][-1] == r["valid_bpb"], r
    assert r["decay_rise"] == max(0.0, r["decay_bpb"][1] / r["decay_bpb"][0] - 1), r
  assert "rise in the decay" in (tmp_path / "transformer_lm_lean_state_wsd.md").read_text()


@pytest.mark.slow
def test_transformer_lm_smoke_fp8_modes(tmp_path):
  proc = _run_smoke("transformer_lm.py", tmp_path, "--modes", "autocast_bf16", "fp8_bf16",
                    "fp8_f16", "fp8_bf16_keep_ends", "fp8_bf16_rowwise", "--sensitivity")
  assert proc.returncode == 0, f"transformer_lm.py failed:\n{proc.stdout}\n{proc.stderr}"
  # The autocast column is as wide as its widest cell ("yes, fp8 min_size 0").
  assert re.search(r"\| mode +\| policy +\| autocast +\| valid bits/byte \| vs autocast_bf16 ",
                   proc.stdout), proc.stdout
  payload = json.loads((tmp_path / "transformer_lm_fp8.json").read_text())
  results = payload["results"]
  assert [(r["mode"], r["autocast"], r["fp8"]) for r in results] == [
      ("autocast_bf16", True, ""), ("fp8_bf16", True, "fp8 min_size 0"),
      ("fp8_f16", True, "fp8 min_size 0"),
      ("fp8_bf16_keep_ends", True, "fp8 min_size 0 keep params/(?:Block_0|Dense_0)/"),
      ("fp8_bf16_rowwise", True, "fp8 rowwise min_size 0")]
  assert all(np.isfinite(r["valid_bpb"]) and r["skipped"] == 0 for r in results)
  bpb = [r["valid_bpb"] for r in results]
  assert max(bpb) < 1.01 * min(bpb)  # a few steps from the same weights: FP8 tracks bf16
  assert results[2]["final_scale"] >= 2.0**14
  assert (tmp_path / "transformer_lm_fp8.png").read_bytes().startswith(b"\x89PNG")
  # The sensitivity table: one row per matmul of the smoke model (1 block: q, k, v,
  # scores, values, out, 2 MLP; the read-out), and the keep rule of the worst three.
  md = (tmp_path / "transformer_lm_fp8.md").read_text()
  assert "FP8 sensitivity of the autocast_bf16 model" in md and "Keep rule for the worst 3: `(?:^|/)(?:" in md
  rows = md.split("```text\n")[1].split("```")[0].splitlines()[2:]
  # Long paths are shortened from the left ("...ock_0/MultiHead..."), so look for the block.
  assert len(rows) == 9 and sum("ock_0/" in r.split()[0] for r in rows) == 6, rows


@pytest.fixture
def train_digits(monkeypatch):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  for mod in ("train_digits", "_common"):
    monkeypatch.delitem(sys.modules, mod, raising=False)
  import train_digits

  return train_digits


# Persistent bytes per parameter of the digits CNN's lean-state modes (memory_ledger): bf16
# masters, coded moments, and the small leaves' float32 moments.
LEAN_BYTES = {"bf16_lean_int8": (4.0, 4.3), "bf16_lean_float8": (4.0, 4.3),
              "bf16_lean_int4": (3.0, 3.4)}


class DigitsRuns:
  """``train_digits.run`` for 10 epochs from the same data and weights, each mode run once."""

  def __init__(self):
    with pytest.MonkeyPatch.context() as mp:
      self.module = _import_example(mp, "train_digits")
    self.data = self.module.load_data(seed=0)
    self.params = self.module.init_params(seed=0)
    self._runs = {}

  def __call__(self, mode, masters="f32"):  # run's default; lean-state modes take bf16 masters
    if (mode, masters) not in self._runs:
      self._runs[mode, masters] = self.module.run(mode, epochs=10, lr=3e-3, seed=0, data=self.data,
                                                  params=self.params, progress=False,
                                                  masters=masters)
    return self._runs[mode, masters]


@pytest.fixture(scope="module")
def digits_runs():
  """The module's digits runs: float32's, the reference of three tests, trains once."""
  return DigitsRuns()


# One worker runs the three, so that they share the float32 run.
@pytest.mark.xdist_group("digits_accuracy")
def test_digits_mixed_precision_matches_fp32_accuracy(digits_runs):
  results = {mode: digits_runs(mode) for mode in digits_runs.module.MODES}
  fp32 = results["fp32"].accuracy
  assert fp32 >= 95.0, results["fp32"]
  for mode in ("bf16", "f16"):
    assert abs(results[mode].accuracy - fp32) <= 1.0, (mode, results[mode].accuracy, fp32)
  f16 = results["f16"]
  assert f16.policy == "p=f32,c=f16,o=f32"
  assert f16.scales[0] == 2.0**15 and f16.final_scale > 2.0**15  # it grew at least once
  assert f16.skipped == int((~f16.finite).sum()) < 10
  assert results["fp32"].skipped == results["bf16"].skipped == 0
  assert results["fp32"].losses[-20:].mean() < 0.1 * results["fp32"].losses[:5].mean()


@pytest.mark.xdist_group("digits_accuracy")
def test_digits_lean_masters_match_fp32_accuracy(digits_runs):
  fp32 = digits_runs("fp32").accuracy
  assert fp32 >= 95.0
  for masters in ("bf16-stochastic", "bf16-kahan"):
    result = digits_runs("bf16", masters)
    assert abs(result.accuracy - fp32) <= 1.0, (masters, result.accuracy, fp32)
    assert result.masters == masters and result.skipped == 0


@pytest.mark.xdist_group("digits_accuracy")
def test_digits_lean_state_matches_fp32_accuracy(digits_runs):
  fp32 = digits_runs("fp32").accuracy
  assert fp32 >= 95.0
  for mode in digits_runs.module.LEAN_STATE:
    result = digits_runs(mode)
    assert abs(result.accuracy - fp32) <= 1.0, (mode, result.accuracy, fp32)
    assert result.masters == "bf16-stochastic" and result.skipped == 0
    assert LEAN_BYTES[mode][0] < result.bytes_per_param < LEAN_BYTES[mode][1], result


def test_digits_run_rejects_unknown_mode(train_digits):
  with pytest.raises(ValueError, match="'fp8'"):
    train_digits.run("fp8", epochs=1)


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--batch", "-1"]])
def test_digits_cli_rejects_bad_sizes(train_digits, argv, capsys):
  with pytest.raises(SystemExit) as exc:
    train_digits.parse_args(argv)
  assert exc.value.code == 2
  assert argv[0] in capsys.readouterr().err


@pytest.mark.slow
def test_weight_updates_smoke_shows_the_stall(tmp_path):
  payload, rows = _smoke_rows("weight_updates.py", "weight_updates", tmp_path)
  assert list(rows) == ["fp32", "bf16-nearest", "bf16-stochastic", "bf16-kahan"]
  assert payload["lr_over_half_ulp"]["fraction_below_1"] > 0.9
  # Even 30 steps show it: nearest-rounded bf16 masters keep nearly every weight.
  assert rows["bf16-nearest"]["moved"] < 10.0 < rows["bf16-kahan"]["moved"]
  assert rows["fp32"]["moved"] == 100.0
  assert [rows[m]["master_bytes"] for m in rows] == [4, 2, 2, 4]
  assert "| bf16-stochastic |" in (tmp_path / "weight_updates.md").read_text()
  png = (tmp_path / "weight_updates.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_digits_masters_flag_adds_lean_runs_and_keeps_default_files(train_digits, tmp_path,
                                                                    monkeypatch, capsys):
  """The flag's plumbing, with training stubbed out (the real runs are tested below)."""
  calls = []

  def fake_run(mode, *, masters="f32", **kwargs):
    calls.append((mode, masters))
    n = 4
    return train_digits.Result(
        mode=mode, policy=train_digits.POLICIES[mode], accuracy=97.0 + 0.1 * len(calls),
        step_ms=1.0, skipped=0, final_scale=1.0, losses=np.linspace(1.0, 0.1, n, dtype=np.float32),
        scales=np.ones(n, np.float32), finite=np.ones(n, bool), masters=masters)

  monkeypatch.setattr(train_digits, "run", fake_run)
  train_digits.main(["--smoke", "--no-progress", "--out", str(tmp_path),
                     "--masters", "bf16-stochastic,bf16-kahan"])
  assert calls == [("fp32", "f32"), ("bf16", "f32"), ("f16", "f32"),
                   ("bf16", "bf16-stochastic"), ("bf16", "bf16-kahan")]
  assert not (tmp_path / "digits.json").exists()  # the default results stay as they are
  payload = json.loads((tmp_path / "digits_masters.json").read_text())
  assert [r["masters"] for r in payload["results"]] == [m for _, m in calls]
  out = capsys.readouterr().out
  assert "| mode | masters         | policy " in out
  assert "bf16-kahan masters: +0.40 points vs fp32 (within 1 point)" in out
  assert (tmp_path / "digits_masters.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_digits_smoke_lean_state_modes(tmp_path):
  proc = _run_smoke("train_digits.py", tmp_path, "--no-progress", "--lean-state")
  assert proc.returncode == 0, f"train_digits.py failed:\n{proc.stdout}\n{proc.stderr}"
  assert not (tmp_path / "digits.json").exists()  # the default results stay as they are
  results = json.loads((tmp_path / "digits_lean_state.json").read_text())["results"]
  assert [(r["mode"], r["masters"]) for r in results] == [
      ("fp32", "f32"), ("bf16_lean_int8", "bf16-stochastic"), ("bf16_lean_float8", "bf16-stochastic"),
      ("bf16_lean_int4", "bf16-stochastic")]
  assert all(r["skipped"] == 0 for r in results)
  assert all(abs(r["accuracy"] - results[0]["accuracy"]) <= 3.0 for r in results)
  # memory_ledger: 12 bytes/param for fp32 Adam; about 4 with bf16 masters and 8-bit moments,
  # about 3 with 4-bit ones (above: the six leaves under min_size=4096 keep float32 moments).
  assert abs(results[0]["bytes_per_param"] - 12.0) < 0.01
  assert all(LEAN_BYTES[r["mode"]][0] < r["bytes_per_param"] < LEAN_BYTES[r["mode"]][1]
             for r in results[1:])
  assert "| bf16_lean_int8   | bf16-stochastic |" in (tmp_path / "digits_lean_state.md").read_text()
  assert "bf16_lean_float8 (4.1" in proc.stdout and "bf16_lean_int4 (3." in proc.stdout


def test_digits_lean_state_modes_refuse_other_masters(train_digits, capsys):
  with pytest.raises(ValueError, match="keeps bf16-stochastic masters, got masters='bf16-kahan'"):
    train_digits.run("bf16_lean_int8", epochs=1, masters="bf16-kahan")
  with pytest.raises(SystemExit) as exc:
    train_digits.parse_args(["--lean-state", "--masters", "bf16-kahan"])
  assert exc.value.code == 2
  assert "--lean-state and --masters" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["train_digits", "char_lm"])
def test_masters_flag_rejects_unknown_names(monkeypatch, capsys, script):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  for mod in (script, "_common"):
    monkeypatch.delitem(sys.modules, mod, raising=False)
  module = __import__(script)
  with pytest.raises(SystemExit) as exc:
    module.parse_args(["--masters", "bf16-stochastic,f16-kahan"])
  assert exc.value.code == 2
  assert "'f16-kahan'" in capsys.readouterr().err
  with pytest.raises(ValueError, match="masters must be one of"):
    module.run("bf16", *(() if script == "train_digits" else (None, None)), masters="fp8")


@pytest.mark.parametrize("script", SCRIPTS)
def test_results_go_to_the_untracked_out_folder_by_default(monkeypatch, script):
  module = _import_example(monkeypatch, script)
  assert module.parse_args([]).out == ROOT / "out"
  assert module.parse_args(["--smoke"]).out is None  # a smoke run writes nothing...
  committed = module.parse_args(["--smoke", "--out", "examples/results"]).out
  assert committed == Path("examples/results")  # ...unless told where
  assert "/out/" in (ROOT / ".gitignore").read_text().splitlines()


def _digests(folder: Path) -> dict[str, str]:
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_train_digits_by_default_says_what_it_does_then_writes_only_to_out(tmp_path):
  """The README's ``python examples/train_digits.py``, on a copy and at 5 steps per mode."""
  tmp_path = tmp_path.resolve()  # what the copied script sees as its own path
  shutil.copytree(EXAMPLES, tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
  committed = _digests(tmp_path / "examples")
  proc = subprocess.run(
      [sys.executable, "examples/train_digits.py", "--epochs", "1", "--batch", "256"],
      cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stdout
  assert _digests(tmp_path / "examples") == committed  # examples/results untouched
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
      "digits.json", "digits.md", "digits.png"]
  out = tmp_path / "out"
  payload = json.loads((out / "digits.json").read_text())
  assert payload["steps_per_mode"] == 5 and payload["config"]["smoke"] is False
  results = payload["results"]
  assert [r["mode"] for r in results] == ["fp32", "bf16", "f16"]
  assert results[2]["final_scale"] >= 2.0**14  # the dynamic scale is live, not the no-op 1.0
  assert results[0]["final_scale"] == 1.0
  header_row = "| mode | policy             | test acc % |"
  assert header_row in proc.stdout and header_row in (out / "digits.md").read_text()
  for row in MODE_ROWS:
    assert row in proc.stdout, proc.stdout
  png = (out / "digits.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000
  # The header, then where the files go, then the first progress bar: stdout and
  # stderr share one pipe, so this is the order a terminal shows.
  header = proc.stdout.index("load_digits: 1347 train / 450 test images; 5 steps of batch 256 "
                             "per run; runs fp32, bf16, f16;")
  where = proc.stdout.index(f"results will be written to {tmp_path / 'out'}")
  first_bar = proc.stdout.index("%|")
  table = proc.stdout.index("| mode | policy ")
  assert header < where < first_bar < table, proc.stdout


@pytest.mark.slow
def test_nnx_cnn_smoke_trains_four_ways_and_reports_what_ran_in_half(tmp_path):
  payload, results = _smoke_rows("nnx_cnn.py", "nnx_cnn", tmp_path)
  assert list(results) == ["fp32", "f16", "f16_autocast", "bf16"]
  assert payload["steps_per_mode"] == 6
  assert results["f16"]["final_scale"] >= 2.0**14 and results["fp32"]["final_scale"] == 1.0
  matmuls = {m: r["report"].splitlines()[1].split() for m, r in results.items()}
  # NNX BatchNorm promotes to its float32 statistics: the Linear layers after it run in
  # float32 under the plain half policy, and in float16 under autocast.
  assert matmuls["f16"] == ["matmul", "0", "2", "2"]
  assert matmuls["f16_autocast"] == ["matmul", "2", "0", "2"]
  assert "| f16_autocast |" in (tmp_path / "nnx_cnn.md").read_text()


def test_progress_bars_show_the_current_run_of_skipped_steps(monkeypatch):
  common = _import_example(monkeypatch, "_common")
  bar = common.progress(range(3), desc="f16", total=3, enabled=False)
  common.show_skips(bar, {"loss": 1.0, "consecutive_skips": np.int32(7)})
  assert bar.postfix == "skips in a row: 7"
  common.show_skips(bar, {"loss": 1.0})  # no loss scaling: nothing to show
  assert bar.postfix == "skips in a row: 7"
  bar.close()
