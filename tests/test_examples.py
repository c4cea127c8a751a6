"""The examples run end to end (``--smoke``, as CI does) and digits reaches fp32 accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODE_ROWS = ("| fp32 ", "| bf16 ", "| f16 ")


def _run_smoke(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
  # Import this checkout's jmp_lite, whatever the environment has installed.
  path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
  env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": path}
  return subprocess.run(
      [sys.executable, str(Path("examples") / script), "--smoke", "--out", str(out), *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.mark.parametrize(
    "script, name, header",
    [
        ("train_digits.py", "digits", "| mode | policy             | test acc % |"),
        ("char_lm.py", "char_lm", "| mode | policy             | valid ppl/byte |"),
    ],
    ids=["train_digits", "char_lm"],
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
  if name == "digits":
    png = (tmp_path / "digits.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_transformer_lm_smoke_trains_four_ways(tmp_path):
  proc = _run_smoke("transformer_lm.py", tmp_path)
  assert proc.returncode == 0, f"transformer_lm.py failed:\n{proc.stdout}\n{proc.stderr}"
  lines = proc.stdout.splitlines()
  assert lines[0].startswith("stdlib source:") and lines[1].startswith("training fp32")
  modes = ["fp32", "mixed_f16", "autocast_f16", "autocast_bf16"]
  for mode in modes:
    assert f"| {mode} " in proc.stdout, proc.stdout
  payload = json.loads((tmp_path / "transformer_lm.json").read_text())
  results = payload["results"]
  assert payload["config"]["smoke"] is True
  assert [r["mode"] for r in results] == modes
  assert [r["autocast"] for r in results] == [False, False, True, True]
  assert all(np.isfinite(r["valid_bpb"]) and r["skipped"] == 0 for r in results)
  assert results[2]["final_scale"] >= 2.0**14 and results[3]["final_scale"] == 1.0
  png = (tmp_path / "transformer_lm.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_autocast_overhead_compares_programs_with_the_same_dtypes(monkeypatch):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  for mod in ("autocast_overhead", "transformer_lm", "char_lm", "_common"):
    monkeypatch.delitem(sys.modules, mod, raising=False)
  import autocast_overhead as overhead
  import jax
  import jax.numpy as jnp

  import jmp_lite as jmp

  policy = jmp.get_policy("mixed_float16")
  params = policy.cast_to_compute(overhead.init(jax.random.key(0), 16, 1, 8))
  tokens = np.random.default_rng(0).integers(0, 256, (2, 9))
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  natural = lambda p, b: overhead.loss(p, b, heads=2, c=overhead.Casts(hand=False))
  hand = lambda p, b: overhead.loss(p, b, heads=2, c=overhead.Casts(hand=True))
  autocast_sig = overhead.dtype_signature(jmp.autocast(natural, jnp.float16), params, batch)
  assert autocast_sig == overhead.dtype_signature(hand, params, batch)
  assert autocast_sig != overhead.dtype_signature(natural, params, batch)  # autocast changed it
  assert ("exp", ("float32",)) in autocast_sig and ("dot_general", ("float16",)) in autocast_sig


@pytest.fixture
def train_digits(monkeypatch):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  for mod in ("train_digits", "_common"):
    monkeypatch.delitem(sys.modules, mod, raising=False)
  import train_digits

  return train_digits


def test_digits_mixed_precision_matches_fp32_accuracy(train_digits):
  data = train_digits.load_data(seed=0)
  params = train_digits.init_params(seed=0)
  results = {
      mode: train_digits.run(
          mode, epochs=10, lr=3e-3, seed=0, data=data, params=params, progress=False
      )
      for mode in train_digits.MODES
  }
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


def test_digits_run_rejects_unknown_mode(train_digits):
  with pytest.raises(ValueError, match="'fp8'"):
    train_digits.run("fp8", epochs=1)


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--batch", "-1"]])
def test_digits_cli_rejects_bad_sizes(train_digits, argv, capsys):
  with pytest.raises(SystemExit) as exc:
    train_digits.parse_args(argv)
  assert exc.value.code == 2
  assert argv[0] in capsys.readouterr().err


def test_weight_updates_smoke_shows_the_stall(tmp_path):
  proc = _run_smoke("weight_updates.py", tmp_path, "--no-progress")
  assert proc.returncode == 0, f"weight_updates.py failed:\n{proc.stdout}\n{proc.stderr}"
  payload = json.loads((tmp_path / "weight_updates.json").read_text())
  rows = {r["mode"]: r for r in payload["results"]}
  assert list(rows) == ["fp32", "bf16-nearest", "bf16-stochastic", "bf16-kahan"]
  assert payload["config"]["smoke"] is True and payload["lr_over_half_ulp"]["fraction_below_1"] > 0.9
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


def test_digits_lean_masters_match_fp32_accuracy(train_digits):
  data = train_digits.load_data(seed=0)
  params = train_digits.init_params(seed=0)
  run = lambda mode, masters: train_digits.run(
      mode, epochs=10, lr=3e-3, seed=0, data=data, params=params, progress=False, masters=masters)
  fp32 = run("fp32", "f32").accuracy
  assert fp32 >= 95.0
  for masters in ("bf16-stochastic", "bf16-kahan"):
    result = run("bf16", masters)
    assert abs(result.accuracy - fp32) <= 1.0, (masters, result.accuracy, fp32)
    assert result.masters == masters and result.skipped == 0


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
