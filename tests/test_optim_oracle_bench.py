"""``python -m benchmarks.optim_oracle`` (issues 35, 43): its JAX side, its matrix and its report.

The benchmark itself needs torch and torchao, which the tests never install;
its numbers are committed in ``benchmarks/results/optim-oracle-*``. These
tests run the JAX side on a few steps and the report on made-up numbers; the
cooldown's torch side, and its smoke run, only where torch and torchao are
installed (they skip otherwise).
"""

from __future__ import annotations

import sys

import json

import jax
import numpy as np
import optax
import pytest

from benchmarks.optim_oracle import command
from benchmarks.optim_oracle import cooldown
from benchmarks.optim_oracle import drift
from benchmarks.optim_oracle import problems as problems_lib
from benchmarks.optim_oracle import sweep
from benchmarks.optim_oracle import tables
from benchmarks.optim_oracle import variants

PROBLEMS = problems_lib.PROBLEMS


@pytest.mark.parametrize("missing", ["torch", "torchao.optim"])
def test_without_torch_or_torchao_it_exits_naming_the_install(monkeypatch, capsys, missing):
  monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
  if missing == "torchao.optim":
    monkeypatch.setitem(sys.modules, "torchao", None)
  with pytest.raises(SystemExit) as exc:
    command.main(["--smoke"])
  message = str(exc.value.code)
  assert "pip install torch torchao" in message and "'.[oracle]'" in message
  assert capsys.readouterr().out == ""  # nothing measured, nothing written


def test_an_unknown_problem_or_part_is_a_usage_error(capsys):
  for argv in (["--problems", "mlp_tanh,nope"], ["--parts", "matrix,nope"]):
    with pytest.raises(SystemExit) as exc:
      command.main(argv)
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_the_matrix_covers_what_issue_43_asks_for():
  ps = list(PROBLEMS.values())
  assert len(ps) >= 12
  assert {p.activation for p in ps} >= {"tanh", "gelu", "relu"}
  assert {p.model for p in ps} == {"mlp", "cnn", "lstm", "transformer"}
  assert min(p.steps for p in ps) == 100 and max(p.steps for p in ps) == 2000
  assert min(p.lr for p in ps) == 1e-4 and max(p.lr for p in ps) == 1e-2
  assert {p.weight_decay > 0 for p in ps} == {True, False}
  # The issue's case: a 3-layer GELU classifier, 200 AdamW steps at lr 3e-3.
  case = PROBLEMS["gelu_classifier"]
  assert (case.model, case.activation, len(case.sizes) - 1, case.steps, case.lr) == (
      "mlp", "gelu", 3, 200, 3e-3)
  assert case.data == "teacher_classes"
  assert command.build_parser().parse_args([]).seeds == 4


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_jmp_codes_exactly_the_tensors_torchao_codes(name):
  """torchao codes a tensor of >= 4096 elements, a multiple of its block of 256; so must we."""
  inst = problems_lib.instance(PROBLEMS[name], 0, steps=1)
  torchao_rule = sorted(k for k, v in inst.params.items() if v.size >= 4096 and v.size % 256 == 0)
  assert 0 < len(torchao_rule) < len(inst.params)  # some coded, some not
  params = jax.tree.map(jax.numpy.asarray, inst.params)
  for n in ("jmp_int8", "jmp_float8"):
    state = variants.make_tx(n, 1e-3, 0.0).init(params)
    assert variants.coded_leaves(state, params) == torchao_rule, n


@pytest.mark.parametrize("name", ["gelu_classifier", "cnn_relu", "lstm", "transformer_gelu"])
def test_each_model_has_a_finite_gradient_for_every_parameter(name):
  problem = PROBLEMS[name]
  inst = problems_lib.instance(problem, 0, steps=2)
  idx = inst.batches[0]
  loss, grads = jax.jit(jax.value_and_grad(inst.loss))(inst.params, inst.x[idx], inst.y[idx])
  assert np.isfinite(float(loss)) and float(loss) > 0
  for k, g in grads.items():
    assert g.shape == inst.params[k].shape and g.dtype == np.float32
    assert np.all(np.isfinite(g)) and np.any(g != 0), k


def test_an_instance_is_fixed_by_its_seed():
  p = PROBLEMS["lstm"]
  a, b, c = (problems_lib.instance(p, s) for s in (0, 0, 1))
  for x, y in ((a.params["wh"], b.params["wh"]), (a.x, b.x), (a.batches, b.batches)):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a.params["wh"], c.params["wh"])
  assert not np.array_equal(a.batches, c.batches)
  assert a.batches.shape == (p.steps, problems_lib.BATCH)


def test_each_variant_drifts_from_its_own_sides_float32_family():
  assert variants.reference("jmp_int8") == "optax_adamw"
  assert variants.reference("torchao_adamwfp8") == "torch_adamw"
  assert variants.reference("jmp_lion_float8") == "optax_lion"
  assert variants.reference("jmp_sgdm_int8") == "optax_sgdm"
  p0 = {"w": np.zeros(2, np.float32)}
  finals = {"optax_adamw": {"w": np.array([3.0, 4.0], np.float32)},
            "jmp_int8": {"w": np.array([3.0, 4.5], np.float32)}}
  assert drift.seed_drifts(finals, p0) == {"optax_adamw": 0.0, "jmp_int8": 0.1}


def test_a_problems_ratio_is_mean_drift_over_mean_drift():
  by_seed = [{"jmp_int8": dict(drift=0.01, loss=1.0), "torchao_adamw8bit": dict(drift=0.04, loss=1.0)},
             {"jmp_int8": dict(drift=0.03, loss=2.0), "torchao_adamw8bit": dict(drift=0.02, loss=1.0)}]
  s = drift.summarize(by_seed)
  assert s["ratios"]["jmp_int8"] == pytest.approx(0.02 / 0.03)
  assert s["ratios_by_seed"]["jmp_int8"] == pytest.approx([0.25, 1.5])
  assert s["variants"]["jmp_int8"] == pytest.approx(dict(drift=0.02, drift_max=0.03, loss=1.5))


def test_the_jax_side_trains_and_its_float32_run_has_no_drift():
  res = drift.run_problem(PROBLEMS["mlp_tanh"], [0, 1], ["optax_adamw", "jmp_int8"], steps=3)
  v = res["variants"]
  assert v["optax_adamw"]["drift"] == 0.0
  assert 0 < v["jmp_int8"]["drift"] < 1 and np.isfinite(v["jmp_int8"]["loss"])
  assert res["coded"]["jmp_int8"] == ["w0", "w1"] and res["coded"]["optax_adamw"] == []
  assert res["steps"] == 3 and len(res["by_seed"]) == 2 and res["torch_vs_optax_adamw"] is None


def test_the_sweep_runs_30_or_more_ratios_from_1_to_1e_8():
  rs = sweep.ratios(command.build_parser().parse_args([]).ratios)
  assert len(rs) >= 30 and rs[0] == 1.0 and rs[-1] == pytest.approx(1e-8)
  assert np.allclose(np.diff(np.log10(rs)), np.log10(rs[1]))  # log-spaced
  mags = sweep.magnitudes(np.array([1.0, 1e-3]), rows=2)
  assert mags.shape == (2, 2, 256)
  assert set(mags[1, :, 0::2].ravel()) == {1.0} and set(mags[1, :, 1::2].ravel()) == {
      np.float32(1e-3)}


def test_the_sweeps_jax_side_measures_each_ratio_against_float32_adam():
  res = sweep.run_sweep(["optax_adamw", "jmp_int8"], n_ratios=4, rows=4, steps=5, lr=1e-3, seed=0)
  assert res["variants"]["optax_adamw"]["vs_fp32"] == [1.0] * 4
  largest = np.array(res["variants"]["optax_adamw"]["largest"])
  assert np.all((largest > 0.5e-3) & (largest < 5e-3))  # Adam's steps are about lr
  assert all(0.5 < x < 10 for x in res["variants"]["jmp_int8"]["vs_fp32"])
  with pytest.raises(ValueError, match="4096"):
    sweep.run_sweep(["optax_adamw"], n_ratios=3, rows=4, steps=1, lr=1e-3, seed=0)


def _problem(name, int8, ao8, fp8, aofp8, coded_torch=("w",)):
  names = {"optax_adamw": 0.0, "jmp_int8": int8, "jmp_float8": fp8, "torch_adamw": 0.0,
           "torchao_adamw8bit": ao8, "torchao_adamwfp8": aofp8, "jmp_lion_int8": 0.05}
  by_seed = [{n: dict(drift=d, loss=0.5) for n, d in names.items()}]
  return dict(problem=name, describe="mlp 2-2 tanh", steps=10, lr=1e-3, weight_decay=0.0,
              note="", seeds=[0], by_seed=by_seed, **drift.summarize(by_seed),
              coded={"jmp_int8": ["w"], "torchao_adamw8bit": list(coded_torch)},
              sizes={"w": 4096, "b": 2}, torch_vs_optax_adamw=1e-5, seconds=1.0)


def _result(problems, sweep_vs=(1.0, 1.2, 1.6)):
  sw = dict(ratios=[1.0, 1e-4, 1e-8], rows=4, steps=10, lr=1e-3, seconds=1.0, variants={
      "optax_adamw": dict(largest=[1e-3] * 3, vs_fp32=[1.0] * 3),
      "jmp_int8": dict(largest=[1e-3] * 3, vs_fp32=list(sweep_vs)),
      "jmp_float8": dict(largest=[1e-3] * 3, vs_fp32=[1.0, 1.1, 1.0])})
  result = dict(problems=problems, sweep=sw, summary=dict(
      ratios=tables.ratio_summary(problems), families=tables.family_summary(problems)))
  result["bars"] = tables.check_bars(result, meaningful=True)
  result["meta"] = {"device_kind": "cpu", "platform": "cpu", "versions": {"jax": "0"},
                    "date": "d", "command": "c", "commit": "abc1234"}
  return result


def test_bars_take_the_worst_and_the_median_problem_and_the_worst_ratio_of_the_sweep():
  ps = [_problem("a", 0.01, 0.04, 0.01, 0.1), _problem("b", 0.03, 0.02, 0.02, 0.1),
        _problem("c", 0.01, 0.02, float("nan"), 0.1, coded_torch=())]
  bars = {b["what"]: (b["value"], b["passed"]) for b in _result(ps)["bars"]}
  worst = bars["jmp_int8 drift / torchao_adamw8bit drift, worst problem (b)"]
  assert worst == (pytest.approx(1.5), False)
  assert bars["jmp_int8 drift / torchao_adamw8bit drift, median over problems"] == (0.5, True)
  # A run that diverged (NaN drift) is the worst problem, and fails.
  nan_worst = bars["jmp_float8 drift / torchao_adamwfp8 drift, worst problem (c)"]
  assert np.isnan(nan_worst[0]) and nan_worst[1] is False
  assert bars["jmp_int8: largest step / fp32 Adam's, worst of 3 ratios (at 1e-08)"] == (1.6, False)
  assert bars["jmp_float8: largest step / fp32 Adam's, worst of 3 ratios (at 0.0001)"] == (1.1, True)
  assert bars["problems where jmp and torchao coded different parameters: c"] == (1, False)
  assert command.report.bars_status(_result(ps)["bars"], strict=True) == 1
  assert command.report.bars_status(_result(ps[:1], (1.0,) * 3)["bars"], strict=True) == 0


def test_the_report_shows_each_problem_the_median_the_worst_and_the_sweep():
  text = tables.markdown(_result([_problem("a", 0.01, 0.04, 0.01, 0.1),
                                  _problem("b", 0.03, 0.02, 0.02, 0.1)]))
  assert "Measured at commit `abc1234`." in text
  assert "jmp_int8 / torchao_adamw8bit: median **0.88x**, worst **1.50x** (b)." in text
  assert ("| a | mlp 2-2 tanh | 10 | 0.001 | 0 | 1.00% (1.00%) | 4.00% (4.00%) | 0.25x | "
          "1.00% (1.00%) | 10.00% (10.00%) | 0.10x | 0.00% | w (4096) |") in text
  assert "- jmp_lion_int8: median 5.00%, worst 5.00% (b)." in text
  assert "| 1e-08 | 1.000 | 1.60x | 1.00x |" in text


# ------------------------------------------------------------------ the cooldown


def test_the_cooldown_warms_up_holds_and_falls_to_zero_over_the_last_tenth():
  steps = 200
  warmup, start = cooldown.phases(steps)
  assert (warmup, start) == (10, 180)  # 5% and the last 10% of the steps
  assert cooldown.phases(cooldown.STEPS) == (50, 900)
  lrs = cooldown.lr_values(steps)
  peak = np.float32(cooldown.PEAK_LR)
  assert cooldown.PEAK_LR == 3 * PROBLEMS[cooldown.PROBLEM].lr
  np.testing.assert_allclose(lrs[:warmup + 1], np.linspace(0.0, peak, warmup + 1), rtol=1e-6)
  assert lrs[0] == 0.0 and np.all(lrs[warmup:start + 1] == peak)
  np.testing.assert_allclose(lrs[start:], np.linspace(peak, 0.0, steps - start), rtol=1e-5,
                             atol=1e-12)
  assert lrs[-1] == 0.0 and lrs[-2] > 0.0  # exactly 0 at the last step, and only there
  assert np.all(np.diff(lrs[start:]) < 0)
  with pytest.raises(ValueError, match="at least 20 steps"):
    cooldown.phases(19)


def test_the_torch_side_gets_the_lr_optax_applies_at_each_step():
  """optax's count is the number of earlier updates: step t runs at lrs[t], as torch's does."""
  steps = 40
  lrs = cooldown.lr_values(steps)
  tx = optax.scale_by_learning_rate(cooldown.schedule(lrs))
  update = jax.jit(tx.update)
  ones = {"w": jax.numpy.ones(3)}
  state = tx.init(ones)
  applied = []
  for _ in range(steps):
    u, state = update(ones, state)
    applied.append(-np.asarray(u["w"]))
  np.testing.assert_array_equal(np.array(applied), np.repeat(lrs[:, None], 3, axis=1))


@pytest.mark.parametrize("name", ["jmp_int4", "torch_adamw", "torchao_adamw8bit",
                                  "torchao_adamw4bit"])
def test_a_step_at_lr_0_leaves_the_weights_where_they_are(name):
  """Both sides read the lr at every step: two steps at the peak move the weights, one at 0 not.

  torchao holds the lr as a tensor that a float may not replace; torch's
  optimizers were built at the problem's lr, so a step that ignored the
  schedule would move them.
  """
  if variants.VARIANTS[name].side == "torch":
    pytest.importorskip("torchao.optim")
  problem = PROBLEMS[cooldown.PROBLEM]
  inst = problems_lib.instance(problem, 0, steps=3)
  lrs = np.array([cooldown.PEAK_LR, cooldown.PEAK_LR, 0.0], np.float32)
  grads = variants.grad_function(problem)
  x, y = jax.device_put(inst.x), jax.device_put(inst.y)
  after = []

  def keep(t, params):
    after.append({k: np.array(v, copy=True) for k, v in params.items()})

  if variants.VARIANTS[name].side == "jax":
    _, coded = variants.jax_trainer(name, problem, grads, cooldown.schedule(lrs))(
        inst, x, y, keep)
  else:
    _, coded = variants.torch_train(name, problem, inst, grads, x, y, lrs, keep)
  assert coded == ([] if variants.VARIANTS[name].format is None else ["w1", "w2", "wo", "wqkv"])
  for k in inst.params:
    assert not np.array_equal(after[0][k], inst.params[k]), k
    assert not np.array_equal(after[1][k], after[0][k]), k
    np.testing.assert_array_equal(after[2][k], after[1][k], err_msg=k)


def test_the_largest_rise_is_from_the_lowest_loss_before_it_and_divergence_is_flagged():
  assert cooldown.largest_rise([1.0, 0.9, 0.95, 0.8]) == pytest.approx(0.95 / 0.9 - 1)
  assert f"{100 * cooldown.largest_rise([1.0, 0.9, 0.95, 0.8]):.2f}%" == "5.56%"
  assert cooldown.largest_rise([1.0, 0.9, 0.8]) == 0.0
  assert cooldown.largest_rise([1.0, 1.02, 0.5, 0.55]) == pytest.approx(0.1)
  assert np.isnan(cooldown.largest_rise([1.0, float("inf")]))
  assert [cooldown.diverged(ls) for ls in ([1.0, 1.9, 1.5], [1.0, 2.1, 0.5], [1.0, float("nan")],
                                           [float("inf"), 1.0])] == [False, True, True, True]


def _cooldown_run(name, losses):
  return dict(variant=name, steps=20, peak_lr=3e-3, weight_decay=1e-2, points=[18, 19, 20],
              seeds=[0, 1], losses=losses, coded=["w"], seconds=1.0)


def test_the_cooldown_summary_and_its_bars_take_the_worst_seed_of_each_jmp_format():
  runs = {"optax_adamw": _cooldown_run("optax_adamw", [[2.0, 1.9, 1.8], [2.0, 1.9, 1.9]]),
          "jmp_int8": _cooldown_run("jmp_int8", [[2.0, 1.9, 1.9185], [2.0, 1.9, 1.9]]),
          "jmp_int4": _cooldown_run("jmp_int4", [[2.0, 1.9, 1.9], [2.0, 1.9, 1.9095]]),
          "torch_adamw": _cooldown_run("torch_adamw", [[2.0, 1.9, 1.8], [2.0, 1.9, 1.9]]),
          "torchao_adamw4bit": _cooldown_run("torchao_adamw4bit",
                                             [[2.0, 1.9, 5.0], [2.0, float("nan"), 1.0]])}
  c = cooldown.summarize(runs)
  assert c["variants"]["jmp_int8"]["rise_worst"] == pytest.approx(1.9185 / 1.9 - 1)
  assert c["variants"]["jmp_int4"]["rise_median"] == pytest.approx(0.0025)
  assert c["variants"]["jmp_int8"]["vs_fp32_worst"] == pytest.approx(1.9185 / 1.8)
  assert c["variants"]["torchao_adamw4bit"]["diverged"] == [0, 1]
  assert c["variants"]["optax_adamw"]["curve"] == [2.0, 1.9, 1.85]
  assert (c["phases"], c["matrix_lr"]) == ([1, 18], 1e-3)
  result = _result([])
  result["cooldown"] = c
  bars = {b["what"]: (b["value"], b["passed"]) for b in tables.check_bars(result, True)}
  what = "{}: largest rise of the held-out loss in the decay to lr 0, worst seed of 2"
  assert bars[what.format("jmp_int8")] == (pytest.approx(0.0097, abs=1e-4), True)
  assert bars[what.format("jmp_int4")] == (pytest.approx(0.005), True)
  assert not any(w.startswith("torchao") for w in bars)  # torchao is reported, not barred
  runs["jmp_int8"]["losses"][1] = [2.0, 1.9, 1.92]
  result["cooldown"] = cooldown.summarize(runs)
  bars = {b["what"]: b["passed"] for b in tables.check_bars(result, True)}
  assert bars[what.format("jmp_int8")] is False
  text = tables.markdown(result)
  assert ("| jmp_int4 | jmp.quantize_state(optax.adamw, 'int4') | 0.50% | 0.25% | 1.9047 | 1.0303x | "
          "1.0556x | none | w |") in text
  assert "| torchao_adamw4bit | torchao.optim.AdamW4bit | nan% | nan% |" in text
  assert "| optax_adamw | 2.0000 | 1.9000 | 1.8500 |" in text


def test_the_cooldown_smoke_run_end_to_end(tmp_path, capsys):
  pytest.importorskip("torchao.optim")
  argv = ["--smoke", "--parts", "cooldown", "--formats", "int4", "--jobs", "1",
          "--out", str(tmp_path)]
  assert command.main(argv) == 0
  (path,) = tmp_path.glob("optim-oracle-*.json")
  result = json.loads(path.read_text())
  assert result["problems"] == [] and result["sweep"] is None
  c = result["cooldown"]
  assert (c["steps"], c["seeds"], c["points"]) == (20, [0], [18, 19, 20])
  assert list(c["variants"]) == ["optax_adamw", "jmp_int4", "torch_adamw", "torchao_adamw4bit"]
  for n, v in c["variants"].items():
    (s,) = v["by_seed"]
    assert np.all(np.isfinite(v["curve"])) and not s["diverged"], n
    assert np.isfinite(s["rise"]) and s["rise"] == v["rise_worst"], n
    assert s["final"] == v["curve"][-1] == v["final"], n
    assert v["curve"][-1] == v["curve"][-2], n  # the last step is at lr 0
    assert v["curve"][1] < v["curve"][0], n  # the one before it is not
  assert c["variants"]["optax_adamw"]["vs_fp32_median"] == 1.0
  for n in ("jmp_int4", "torchao_adamw4bit"):
    assert c["variants"][n]["coded"] == ["w1", "w2", "wo", "wqkv"]
  assert [b["model"] for b in result["bars"]] == ["cooldown"]
  assert "**Cooldown** on transformer_gelu, 20 steps, seeds 0:" in capsys.readouterr().out
