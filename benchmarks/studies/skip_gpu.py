"""Where the dynamic-scaling skip's time goes on a GPU: hand-written steps that add one piece at a time.

Run ``PYTHONPATH=. python -m benchmarks.studies.skip_gpu --out DIR`` on a
machine whose JAX has CUDA. On the ``gpu`` preset's Transformer it times,
interleaved (``benchmarks/measure.py``):

- ``f16_noscale``: the hand-written f16 step with no scaling (the baseline of
  the ``overhead`` bar);
- ``sumsq``: the same, and it also returns the gradients' sum of squares, one
  float32 reduction per leaf, the finite check jmp_lite's skip runs;
- ``sumsq_concat``: the same sum taken over all leaves at once (one
  concatenated reduction, which XLA can fuse into one kernel);
- ``select``: ``sumsq``, and the new params and Adam state chosen against the
  old ones on ``isfinite(sumsq)`` (the skip's select, without a loss scale);
- ``f16_dynamic``: jmp_lite's step with dynamic loss scaling;
- ``flax_dynamic``: Flax's ``DynamicScale``, hand-written as its docs do it.

It prints a table of step times relative to ``f16_noscale`` and writes
``skip-gpu-<device>-<date>.{json,md}``. On a CPU it runs the smoke sizes.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.studies.skip_gpu"
PIECES = ("sumsq", "sumsq_concat", "select")


def sumsq_of(grads: Any, concat: bool) -> jax.Array:
  """The float32 sum of squares of every gradient: per leaf, or over one concatenation."""
  leaves = [g.astype(jnp.float32) for g in jax.tree.leaves(grads)]
  if concat:
    return jnp.sum(jnp.square(jnp.concatenate([g.ravel() for g in leaves])))
  return sum(jnp.sum(jnp.square(g)) for g in leaves)


def piece_step(loss_fn: Any, tx: Any, piece: str) -> Any:
  """The hand-written f16 step with ``piece`` of the skip added (module docstring)."""

  def step(state: Any, batch: Any) -> Any:
    params, opt_state = state
    batch = variants_lib.cast_floating(batch, jnp.float16)

    def f(p: Any) -> jax.Array:
      return loss_fn(variants_lib.cast_floating(p, jnp.float16), batch).astype(jnp.float32)

    loss, grads = jax.value_and_grad(f)(params)
    sumsq = sumsq_of(grads, concat=piece == "sumsq_concat")
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if piece == "select":
      finite = jnp.isfinite(sumsq)
      new_params, new_opt = jax.tree.map(lambda n, o: jnp.where(finite, n, o),
                                         (new_params, new_opt), (params, opt_state))
    return (new_params, new_opt), loss + 0.0 * sumsq

  return step


def variant(name: str, problem: models.Problem) -> variants_lib.Variant:
  """A variant of this study: one of :data:`PIECES`, or one of ``benchmarks/variants.py``."""
  if name not in PIECES:
    return variants_lib.make_variant(name, problem)
  tx = optax.adam(variants_lib.LEARNING_RATE)

  def init() -> Any:
    p = variants_lib.copy_tree(problem.params)
    return (p, tx.init(p))

  step = jax.jit(piece_step(problem.loss_fn, tx, name), donate_argnums=(0,))
  return variants_lib.Variant(name, step, init)


def main(argv: list[str] | None = None) -> int:
  """Times the variants interleaved and writes the report."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = cli.parser(PROG, __doc__, "")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--repeats", type=cli.positive_int, default=7)
  args = p.parse_args(argv)
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  problem = models.build_problem("transformer", "gpu" if on_gpu else "smoke")
  names = ["f16_noscale", *PIECES, "f16_dynamic", "flax_dynamic"]
  lives = [measure.prepare(variant(n, problem), problem.batch, 3) for n in names]
  inner = measure.calibrate(lives, problem.batch, 0.2 if on_gpu else 0.01)
  measure.time_interleaved(lives, problem.batch, args.repeats, inner)
  records = {live.variant.name: measure.finish_record(live) for live in lives}
  base = records["f16_noscale"]["step_s"]["samples"]
  rows = ["| variant | step ms | / f16_noscale (median) | paired median | temp MiB |",
          "|---|---|---|---|---|"]
  for n, r in records.items():
    c = measure.compare(r["step_s"]["samples"], base)
    temp = r["memory_bytes"]["temp"]
    rows.append(f"| {n} | {r['step_s']['median'] * 1e3:.2f} | {c['median']:.3f} | "
                f"{c['paired_median']:.3f} | {temp / 2**20 if temp else float('nan'):.0f} |")
  meta = report.meta(cli.command(PROG, argv), device, args=cli.args_record(args))
  text = "\n".join([report.meta_line(meta), "", f"Transformer `{problem.config}`, {inner} steps "
                    f"a sample, {args.repeats} samples each, interleaved.", "", *rows]) + "\n"
  print(text)
  stem = report.output_dir(args.out, not on_gpu) / f"skip-gpu-{report.machine_name(device)}-{meta['date']}"
  report.write(dict(meta=meta, config=problem.config, inner=inner, variants=records), stem, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
