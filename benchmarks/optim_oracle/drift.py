"""Drift on one problem: each optimizer's final parameters against its side's float32 run.

The drift of a run is the distance of its final parameters from those of the
same side's float32 optimizer of the same family (``optax.adamw`` for
``jmp_int8``, ``torch.optim.AdamW`` for torchao's, ``optax.lion`` for the
coded lions...), over the distance that float32 run moved them from the
initial weights. A problem's drift for a variant is the mean over its seeds;
its ratio for ``jmp_int8`` is that mean over ``torchao_adamw8bit``'s.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from benchmarks.optim_oracle import problems as problems_lib
from benchmarks.optim_oracle import variants as variants_lib


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
  """The Euclidean distance between two parameter dicts, in float64.

  Examples:
    >>> import numpy as np
    >>> distance({"w": np.zeros(2, np.float32)}, {"w": np.array([3.0, 4.0], np.float32)})
    5.0
  """
  return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


def seed_drifts(finals: dict[str, dict[str, np.ndarray]], params0: dict[str, np.ndarray]
                ) -> dict[str, float]:
  """Each variant's drift from its side's float32 run, one seed."""
  out = {}
  for n, final in finals.items():
    ref = finals[variants_lib.reference(n)]
    out[n] = distance(final, ref) / distance(ref, params0)
  return out


def summarize(by_seed: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
  """Means over seeds, each rival ratio (mean drift over mean drift), and its seed-by-seed values."""
  names = list(by_seed[0])
  variants = {n: dict(drift=float(np.mean([s[n]["drift"] for s in by_seed])),
                      drift_max=float(np.max([s[n]["drift"] for s in by_seed])),
                      loss=float(np.mean([s[n]["loss"] for s in by_seed]))) for n in names}
  ratios, ratios_by_seed = {}, {}
  for ours, theirs in variants_lib.RIVALS.items():
    if ours in variants and theirs in variants:
      ratios[ours] = variants[ours]["drift"] / variants[theirs]["drift"]
      ratios_by_seed[ours] = [s[ours]["drift"] / s[theirs]["drift"] for s in by_seed]
  return dict(variants=variants, ratios=ratios, ratios_by_seed=ratios_by_seed)


def run_problem(problem: problems_lib.Problem, seeds: list[int], names: list[str],
                steps: int | None = None) -> dict[str, Any]:
  """Every variant in ``names`` on ``problem`` at each seed: drifts, final losses, what was coded.

  Args:
    problem: the problem.
    seeds: the seeds (weights, batches, data).
    names: variants; each one's float32 reference must be among them.
    steps: overrides the problem's steps (a smoke run).

  Returns:
    A JSON-ready dict: the problem, ``by_seed`` (drift and final held-out
    loss per variant), the :func:`summarize` fields, ``coded`` (the
    parameters each variant coded) and ``sizes`` (each parameter's elements).
  """
  start = time.perf_counter()
  eval_loss = jax.jit(problems_lib.make_loss(problem))
  grads = variants_lib.grad_function(problem)
  trainers = {n: variants_lib.jax_trainer(n, problem, grads) for n in names
              if variants_lib.VARIANTS[n].side == "jax"}
  by_seed, coded, cross = [], {}, []
  for seed in seeds:
    inst = problems_lib.instance(problem, seed, steps)
    x, y = jax.device_put(inst.x), jax.device_put(inst.y)
    finals = {}
    for n in names:
      if n in trainers:
        finals[n], coded[n] = trainers[n](inst, x, y)
      else:
        finals[n], coded[n] = variants_lib.torch_train(n, problem, inst, grads, x, y)
    drifts = seed_drifts(finals, inst.params)
    by_seed.append({n: dict(drift=drifts[n], loss=float(eval_loss(finals[n], inst.eval_x,
                                                                   inst.eval_y)))
                    for n in names})
    if {"optax_adamw", "torch_adamw"} <= set(names):  # the two sides solve the same problem
      ref = finals["optax_adamw"]
      cross.append(distance(finals["torch_adamw"], ref) / distance(ref, inst.params))
  return dict(problem=problem.name, describe=problem.describe(), steps=len(inst.batches),
              lr=problem.lr, weight_decay=problem.weight_decay, note=problem.note, seeds=seeds,
              by_seed=by_seed, **summarize(by_seed), coded=coded,
              sizes={k: int(v.size) for k, v in inst.params.items()},
              torch_vs_optax_adamw=max(cross) if cross else None,
              seconds=time.perf_counter() - start)
