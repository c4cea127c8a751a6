"""``python -m benchmarks.optim_oracle`` (issue 35): without torch it stops and says how to install it.

The benchmark itself needs torch and torchao, which the tests never install;
its numbers are committed in ``benchmarks/results/optim-oracle-*``.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from benchmarks import optim_oracle


@pytest.mark.parametrize("missing", ["torch", "torchao.optim"])
def test_without_torch_or_torchao_it_exits_naming_the_install(monkeypatch, capsys, missing):
  monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
  if missing == "torchao.optim":
    monkeypatch.setitem(sys.modules, "torchao", None)
  with pytest.raises(SystemExit) as exc:
    optim_oracle.main(["--smoke"])
  message = str(exc.value.code)
  assert "pip install torch torchao" in message and "'.[oracle]'" in message
  assert capsys.readouterr().out == ""  # nothing measured, nothing written


def test_mlp_gradients_match_finite_differences():
  params = optim_oracle.mlp_init(0)
  x, y = optim_oracle.mlp_batch(0, 3, n=8)
  loss, grads = optim_oracle.mlp_loss_and_grads(params, x, y)
  assert set(grads) == set(params)
  p64 = {n: v.astype(np.float64) for n, v in params.items()}
  x64, y64 = x.astype(np.float64), y.astype(np.float64)
  rng = np.random.default_rng(1)
  for k, p in params.items():
    idx = tuple(int(rng.integers(0, n)) for n in p.shape)

    def loss_at(delta, k=k, idx=idx):
      q = {n: v.copy() for n, v in p64.items()}
      q[k][idx] += delta
      return optim_oracle.mlp_loss_and_grads(q, x64, y64)[0]

    numeric = (loss_at(1e-5) - loss_at(-1e-5)) / 2e-5
    assert abs(numeric - grads[k][idx]) <= 1e-4 * max(1.0, abs(numeric)), k
    assert abs(grads[k][idx]) > 0, k  # the check compares something
  assert loss > 0


def test_bars_compare_our_drift_with_torchaos_and_our_probe_step_with_1_5():
  result = {"drift": {"jmp_int8": {"drift": 0.02}, "torchao_adamw8bit": {"drift": 0.04},
                      "jmp_float8": {"drift": 0.05}, "torchao_adamwfp8": {"drift": 0.04}},
            "blow_up": {"jmp_int8": {"vs_fp32": 1.1}, "jmp_float8": {"vs_fp32": 1.6}}}
  bars = optim_oracle.check_bars(result, meaningful=True)
  assert [(b["value"], b["limit"], b["passed"]) for b in bars] == [
      (0.5, 1.0, True), (1.1, 1.5, True), (1.25, 1.0, False), (1.6, 1.5, False)]


def test_report_lists_every_optimizer_and_each_seeds_ratio():
  def drift(i):
    return {n: {"drift": 0.01 * (k + 1) * (i + 1), "loss": 0.4} for k, n in
            enumerate(optim_oracle.OPTIMIZERS)}

  each = [drift(0), drift(1)]
  mean = {n: dict(v, drift_max=each[1][n]["drift"]) for n, v in each[0].items()}
  result = {"meta": {"device_kind": "cpu", "platform": "cpu", "versions": {"jax": "0"},
                     "date": "d", "command": "c", "args": {"lr": 3e-3, "probe_lr": 1e-3}},
            "steps": 500, "probe_steps": 3000, "drift": mean, "drift_by_seed": each,
            "blow_up": {n: {"over_lr": 1.2, "vs_fp32": 1.0} for n in optim_oracle.OPTIMIZERS}}
  result["bars"] = optim_oracle.check_bars(result, meaningful=True)
  text = optim_oracle.markdown(result)
  for name, (_, what) in optim_oracle.OPTIMIZERS.items():
    assert f"| {name} | {what} |" in text
  assert "| jmp_int8 | jmp.quantize_state(optax.adamw, 'int8') | 2.00% (4.00%) |" in text
  # int8 is the 2nd optimizer, AdamW8bit the 5th: 2/5 at either seed.
  assert "jmp_int8 drift / torchao_adamw8bit drift, seed by seed: 0.40, 0.40" in text
  assert "500 AdamW steps" in text and "2 seeds" in text
