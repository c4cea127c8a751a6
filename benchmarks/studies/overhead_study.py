"""Where does the dynamic-scaling overhead of jmp_lite's step come from?

``python -m benchmarks.studies.overhead_study [--model mlp] [--steps 21]`` times, on
the same model, batch and Adam, interleaved like ``benchmarks.run``:

  base          the hand-written f16 step without scaling (``f16_noscale``).
  lib           jmp_lite: ``make_train_step`` + ``dynamic_loss_scaling``.
  lib_tx        jmp_lite's ``dynamic_loss_scaling`` inside a minimal
                hand-written step (no ``make_train_step``: no grad-norm metric).
  cond_updates  a prototype of the library's current design: unscale, check,
                ``lax.cond`` around the inner update, then ``apply_updates``.
  cond_apply    a prototype: ``lax.cond`` around inner update *and* apply, so a
                skipped step passes params and state through untouched.
  cond_apply_sumsq  cond_apply, with one reduction (the sum of squares of the
                unscaled gradients) giving both the finiteness test
                (``isfinite(sumsq)``) and the grad-norm metric.
  where         a prototype: no cond; unscale, inner update and apply run every
                step, and ``jnp.where`` keeps the old params and state on a
                non-finite step (XLA fuses it into the Adam update).

The prototypes are written here, outside ``jmp_lite/_src``, to measure
proposed changes to the library before making them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
import optax

from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import variants as variants_lib

MODES = ("cond_updates", "cond_apply", "cond_apply_sumsq", "where")


def _proto_step(loss_fn, inner, mode):
  def step(state, batch):
    params, (scale, count, inner_state) = state
    batch = variants_lib.cast_floating(batch, jnp.float16)

    def f(p):
      loss = loss_fn(variants_lib.cast_floating(p, jnp.float16), batch).astype(jnp.float32)
      return loss * scale, loss

    grads, loss = jax.grad(f, has_aux=True)(params)
    inv = 1.0 / scale
    grads = jax.tree.map(lambda g: g * inv, grads)
    kind = mode
    if mode == "cond_apply_sumsq":
      # One reduction gives both the finiteness test and the grad-norm metric.
      sumsq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
      finite, loss = jnp.isfinite(sumsq), {"loss": loss, "grad_norm": jnp.sqrt(sumsq)}
      kind = "cond_apply"
    else:
      finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    if kind == "cond_updates":

      def skip(op):
        return jax.tree.map(lambda g: jnp.full_like(g, -0.0), op[0]), op[1]

      updates, inner_state = jax.lax.cond(
          finite, lambda op: inner.update(op[0], op[1], op[2]), skip, (grads, inner_state, params)
      )
      params = optax.apply_updates(params, updates)
    elif kind == "cond_apply":

      def apply(op):
        p, s = op
        u, s = inner.update(grads, s, p)
        return optax.apply_updates(p, u), s

      params, inner_state = jax.lax.cond(finite, apply, lambda op: op, (params, inner_state))
    elif kind == "where":
      updates, new_inner = inner.update(grads, inner_state, params)
      new_params = optax.apply_updates(params, updates)
      keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
      params = jax.tree.map(keep, new_params, params)
      inner_state = jax.tree.map(keep, new_inner, inner_state)
    else:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    count = jnp.where(finite, count + 1, 0)
    grow = count >= variants_lib.GROWTH_INTERVAL
    scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), jnp.maximum(scale * 0.5, 1.0))
    count = jnp.where(grow, 0, count)
    return (params, (scale, count, inner_state)), loss

  return step


def _lib_tx_step(loss_fn, tx, policy):
  import jmp_lite  # pylint: disable=import-outside-toplevel

  def step(state, batch):
    params, opt_state = state
    scale = jmp_lite.loss_scale_of(opt_state)
    batch = policy.cast_to_compute(batch)

    def f(p):
      loss = loss_fn(policy.cast_to_compute(p), batch).astype(jnp.float32)
      return loss * scale, loss

    grads, loss = jax.grad(f, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def variants(problem: models.Problem) -> list[variants_lib.Variant]:
  """The study's variants (see the module docstring)."""
  import jmp_lite  # pylint: disable=import-outside-toplevel

  inner = optax.adam(variants_lib.LEARNING_RATE)
  jit = lambda f: jax.jit(f, donate_argnums=(0,))  # noqa: E731
  out = [
      variants_lib.make_variant("f16_noscale", problem),
      variants_lib.make_variant("f16_dynamic", problem),
  ]
  out[0].name, out[1].name = "base", "lib"
  tx = jmp_lite.dynamic_loss_scaling(
      inner, init_scale=variants_lib.INIT_SCALE, growth_interval=variants_lib.GROWTH_INTERVAL
  )

  def lib_tx_init():
    p = variants_lib.copy_tree(problem.params)
    return (p, tx.init(p))

  out.append(
      variants_lib.Variant(
          "lib_tx",
          jit(_lib_tx_step(problem.loss_fn, tx, jmp_lite.get_policy("mixed_float16"))),
          lib_tx_init,
          lambda s: jmp_lite.loss_scale_of(s[1]),
      )
  )
  for mode in MODES:

    def init():
      p = variants_lib.copy_tree(problem.params)
      scale = jnp.asarray(variants_lib.INIT_SCALE, jnp.float32)
      return (p, (scale, jnp.zeros((), jnp.int32), inner.init(p)))

    step = jit(_proto_step(problem.loss_fn, inner, mode))
    out.append(variants_lib.Variant(mode, step, init, lambda s: s[1][0]))
  return out


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser("python -m benchmarks.studies.overhead_study", __doc__, "Modes: " + ", ".join(MODES))
  p.add_argument(
      "--model", default="mlp", choices=models.MODELS, help="the model (default: %(default)s)"
  )
  cli.add_timing_arguments(p, "--steps", 21)
  p.add_argument(
      "--device", default="cpu", choices=("cpu", "gpu"), help="where to run (default: %(default)s)"
  )
  p.add_argument("--json", help="also write the results to this file (default: none)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the study and prints step times relative to ``base``."""
  args = build_parser().parse_args(argv)
  cli.select_platform(args)
  problem = models.build_problem(args.model, args.device)
  lives = [measure.prepare(v, problem.batch, args.warmup) for v in variants(problem)]
  inner = measure.calibrate(lives, problem.batch, args.sample_seconds)
  measure.time_interleaved(lives, problem.batch, args.steps, inner)
  base = lives[0].times
  cbase = lives[0].cpu_times
  rows = []
  for live in lives:
    ts = live.times
    wall, cpu = measure.compare(ts, base), measure.compare(live.cpu_times, cbase)
    rows.append(
        dict(
            name=live.variant.name,
            median_ms=statistics.median(ts) * 1e3,
            min_ms=min(ts) * 1e3,
            vs_base=wall["median"],
            vs_base_paired=wall["paired_median"],
            vs_base_of_mins=wall["of_mins"],
            cpu_vs_base=cpu["median"],
            cpu_vs_base_paired=cpu["paired_median"],
            temp_mib=(live.record["memory_bytes"]["temp"] or 0) / 2**20,
        )
    )
  print(f"{args.model} on {jax.devices()[0].device_kind}, {args.steps} repeats x {inner} steps")
  print(
      "| variant | median ms | min ms | vs base (median) | paired | of mins | "
      "CPU-time vs base | CPU paired | temp MiB |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
        f"| {r['name']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['vs_base']:.3f} | "
        f"{r['vs_base_paired']:.3f} | {r['vs_base_of_mins']:.3f} | {r['cpu_vs_base']:.3f} | "
        f"{r['cpu_vs_base_paired']:.3f} | {r['temp_mib']:.1f} |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(model=args.model, repeats=args.steps, inner=inner, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
