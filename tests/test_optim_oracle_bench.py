"""``python -m benchmarks.optim_oracle`` (issues 35, 43): its JAX side, its matrix and its report.

The benchmark itself needs torch and torchao, which the tests never install;
its numbers are committed in ``benchmarks/results/optim-oracle-*``. These
tests run the JAX side on a few steps and the report on made-up numbers.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

from benchmarks.optim_oracle import command
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
