"""Lean master weights: state memory and step time, bf16 masters against float32 masters.

    python -m benchmarks.masters                 # CPU sizes, all models; writes out/
    python -m benchmarks.masters --out benchmarks/results   # regenerate the committed results
    python -m benchmarks.masters --smoke         # a tiny MLP in seconds; writes to a temp folder
    python -m benchmarks.masters --model mlp --variant bf16_stochastic --out /tmp/masters

Every variant is ``jmp.make_train_step`` under the ``mixed_bfloat16`` policy
with ``optax.adam(1e-3)`` on the same model and batch (``benchmarks.models``);
only the master weights change:

  fp32                  ``TrainState.create(params, tx)``: float32 masters
  bf16_nearest          bfloat16 masters, round to nearest (stalls; the cost floor)
  bf16_stochastic       bfloat16 masters, stochastic rounding
  bf16_kahan            bfloat16 masters, Kahan compensation (bf16 buffer)
  *_mu16                the same with Adam's first moment in bfloat16
                        (``optax.adam(..., mu_dtype=jnp.bfloat16)``)

It also compares float16 and bfloat16 storage for tiny updates at three
weight scales (:func:`float16_evidence`), the measurement behind refusing
``master_dtype=float16``.

Memory is what the compiled step takes as arguments
(``step.lower(state, batch).compile().memory_analysis().argument_size_in_bytes``),
divided by the number of parameters; the state's own bytes (without the batch)
and the compiled temp bytes are reported too. Step time is the median over
interleaved repeats (the variants' order rotates every repeat), after warm-up,
each repeat ending with ``jax.block_until_ready``; the ratio to ``fp32`` is
the bar: at most 1.10 on CPU (1.02 on GPU) for stochastic rounding and Kahan.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp
from benchmarks import measure
from benchmarks import models
from benchmarks import report

BARS = {"cpu": 1.10, "gpu": 1.02}
BARRED = ("bf16_stochastic", "bf16_kahan")


# --------------------------------------------------------------------------- #
# Variants
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str
  master_dtype: Any
  rounding: str
  mu_bf16: bool


VARIANTS = (
    Variant("fp32", jnp.float32, "nearest", False),
    Variant("bf16_nearest", jnp.bfloat16, "nearest", False),
    Variant("bf16_stochastic", jnp.bfloat16, "stochastic", False),
    Variant("bf16_kahan", jnp.bfloat16, "kahan", False),
    Variant("fp32_mu16", jnp.float32, "nearest", True),
    Variant("bf16_stochastic_mu16", jnp.bfloat16, "stochastic", True),
    Variant("bf16_kahan_mu16", jnp.bfloat16, "kahan", True),
)


def build(variant: Variant, problem: models.Problem, lr: float = 1e-3):
  """``(step, state)`` for ``variant`` on ``problem``."""
  tx = optax.adam(lr, mu_dtype=jnp.bfloat16 if variant.mu_bf16 else None)
  key = jax.random.key(0) if variant.rounding == "stochastic" else None
  state = jmp.TrainState.create(params=problem.params, tx=tx, master_dtype=variant.master_dtype,
                                rounding=variant.rounding, key=key)
  step = jmp.make_train_step(problem.loss_fn, jmp.get_policy("mixed_bfloat16"))
  return step, state


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #


def param_count(params: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)
             if jnp.issubdtype(x.dtype, jnp.floating))


def state_bytes(state: Any) -> int:
  """Bytes of every array in the state (PRNG keys as their key data)."""
  total = 0
  for x in jax.tree.leaves(state):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    total += int(x.nbytes)
  return total


def _not_skipped(name: str) -> Any:
  """A :attr:`measure.Live.check` that raises if the step skipped its update."""

  def check(metrics: Any) -> None:
    if not bool(metrics["grads_finite"]):
      raise RuntimeError(f"{name}: a step was skipped while timing")

  return check


def prepare(variant: Variant, problem: models.Problem, warmup: int) -> measure.Live:
  step, state = build(variant, problem)
  n = param_count(problem.params)
  t0 = time.perf_counter()
  compiled = step.lower(state, problem.batch).compile()
  compile_s = time.perf_counter() - t0
  mem = measure.memory_bytes(compiled)
  record = dict(
      name=variant.name, master_dtype=np.dtype(variant.master_dtype).name,
      rounding=variant.rounding, mu_bf16=variant.mu_bf16, params=n,
      state_bytes=state_bytes(state), state_bytes_per_param=state_bytes(state) / n,
      memory_bytes=mem, compile_s=compile_s,
      argument_bytes_per_param=None if mem["argument"] is None else mem["argument"] / n,
  )
  for _ in range(warmup):
    state, metrics = compiled(state, problem.batch)
  jax.block_until_ready((state, metrics))
  record["loss_after_warmup"] = float(metrics["loss"])
  return measure.Live(variant, compiled, state, [], record, check=_not_skipped(variant.name))


def bench_model(problem: models.Problem, variants: Sequence[Variant], *, repeats: int,
                inner: int, warmup: int, progress: bool = True) -> dict[str, Any]:
  say = print if progress else (lambda *a, **k: None)
  say(f"[{problem.name}] compiling {len(variants)} variants ({param_count(problem.params):,} params)")
  lives = [prepare(v, problem, warmup) for v in variants]
  say(f"[{problem.name}] timing: {repeats} interleaved repeats of {inner} steps each")
  measure.time_interleaved(lives, problem.batch, repeats, inner)
  base = next(live for live in lives if live.variant.name == "fp32")
  out = []
  for live in lives:
    rec = dict(live.record)
    rec["step_ms_median"] = 1e3 * statistics.median(live.times)
    rec["step_ms_min"] = 1e3 * min(live.times)
    rec["step_ms_max"] = 1e3 * max(live.times)
    rec["vs_fp32"] = statistics.median(live.times) / statistics.median(base.times)
    rec["vs_fp32_paired_median"] = statistics.median(
        a / b for a, b in zip(live.times, base.times))
    rec["cpu_ms_median"] = 1e3 * statistics.median(live.cpu_times)
    rec["cpu_vs_fp32"] = statistics.median(live.cpu_times) / statistics.median(base.cpu_times)
    rec["loss_final"] = float(live.compiled(live.state, problem.batch)[1]["loss"])
    out.append(rec)
  return dict(model=problem.name, config=problem.config, variants=out)


# Why float16 masters are refused: the same tiny-update accumulation in
# float16 and bfloat16 storage, at three weight scales.
FLOAT16_FORMATS = (("float16", "nearest"), ("float16", "kahan"), ("bfloat16", "nearest"),
                   ("bfloat16", "kahan"), ("bfloat16", "stochastic"))


def accumulate(dtype: Any, rounding: str, w0: jax.Array, updates: jax.Array) -> jax.Array:
  """``w0 + sum(updates)`` accumulated one update at a time in ``dtype`` storage (float32 result).

  Uses the library's rounding kernels directly, so that float16 (which the
  public API refuses) can be measured with the same arithmetic.
  """
  from jmp_lite._src import masters as lean  # the kernels, not the public checks

  keys = jax.random.split(jax.random.key(0), updates.shape[0])

  def body(carry, xs):
    p, c = carry
    u, key = xs
    if rounding == "kahan":
      p, c = lean.kahan_add(p, c, u)
    elif rounding == "stochastic":
      p = lean.stochastic_round(p.astype(jnp.float32) + u, jax.random.bits(key, (), jnp.uint32))
    else:
      p = (p.astype(jnp.float32) + u).astype(dtype)
    return (p, c), None

  p = w0.astype(dtype)
  (p, _), _ = jax.lax.scan(body, (p, jnp.zeros_like(p)), (updates, keys))
  return p.astype(jnp.float32)


def float16_evidence(*, steps: int = 1000, n: int = 20000, seed: int = 0) -> list[dict[str, Any]]:
  """RMS error / RMS drift after ``steps`` updates, per weight scale and storage format.

  Weights are N(0, sigma); each update is ``rel * sigma`` times U(0.5, 1.5),
  with a fixed random sign per weight, so every weight drifts ~``steps * rel``
  of its scale. The float64 sum is the reference.
  """
  rng = np.random.default_rng(seed)
  run = jax.jit(accumulate, static_argnums=(0, 1))
  rows = []
  for sigma in (1.0, 1e-2, 1e-4):
    for rel in (1e-3, 1e-4):
      w0 = rng.normal(0.0, sigma, n).astype(np.float32)
      u = (rel * sigma * rng.uniform(0.5, 1.5, (steps, n)) * rng.choice([-1, 1], n))
      u = u.astype(np.float32)
      ref = w0.astype(np.float64) + u.astype(np.float64).sum(0)
      drift = np.sqrt(np.mean((ref - w0) ** 2))
      row = dict(sigma=sigma, update=rel * sigma,
                 subnormal_in_f16=float(np.mean(np.abs(w0) < 2.0**-14)))
      for dtype, rounding in FLOAT16_FORMATS:
        got = np.asarray(run(dtype, rounding, jnp.asarray(w0), jnp.asarray(u)), np.float64)
        row[f"{dtype}-{rounding}"] = float(np.sqrt(np.mean((got - ref) ** 2)) / drift)
      rows.append(row)
  return rows


def float16_markdown(rows: list[dict[str, Any]]) -> str:
  names = [f"{d}-{r}" for d, r in FLOAT16_FORMATS]
  lines = ["| weights N(0, sigma) | update size | " + " | ".join(names)
           + " | weights subnormal in f16 |",
           "|---" * (len(names) + 3) + "|"]
  for row in rows:
    lines.append(f"| sigma={row['sigma']:g} | {row['update']:.0e} | "
                 + " | ".join(f"{row[k]:.4f}" for k in names)
                 + f" | {100 * row['subnormal_in_f16']:.1f}% |")
  return "\n".join(lines)


def check_bars(result: dict[str, Any], limit: float) -> list[dict[str, Any]]:
  bars = []
  for rec in result["variants"]:
    if rec["name"] in BARRED:
      bars.append(dict(model=result["model"], variant=rec["name"], value=rec["vs_fp32"],
                       limit=limit, passed=rec["vs_fp32"] <= limit))
  return bars


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def _fmt(x: float | None, spec: str) -> str:
  return "n/a" if x is None else format(x, spec)


def markdown(payload: dict[str, Any]) -> str:
  meta = payload["meta"]
  lines = [
      f"# Lean master weights: {meta['device_kind']} ({meta['platform']})",
      "",
      f"`{meta['command']}` on {meta['date']}; jax {meta['jax']}, optax {meta['optax']}; "
      f"{meta['repeats']} interleaved repeats of {meta['inner']} steps; policy mixed_bfloat16, "
      "Adam. Bytes per parameter: compiled step arguments (state + batch) / parameters; "
      "state: the TrainState's arrays alone. vs fp32: ratio of median wall times; paired: "
      "median of per-repeat ratios; CPU: this process's CPU time per step (all threads), "
      "which other processes on a shared machine do not stretch.",
  ]
  for result in payload["results"]:
    n = result["variants"][0]["params"]
    lines += ["", f"## {result['model']} ({n:,} parameters; {result['config']})", "",
              "| variant | masters | Adam mu | arg bytes/param | state bytes/param | temp MiB "
              "| step ms (median) | vs fp32 | paired | CPU ms | CPU vs fp32 |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rec in result["variants"]:
      temp = rec["memory_bytes"]["temp"]
      masters = "f32" if rec["master_dtype"] == "float32" else f"bf16 {rec['rounding']}"
      lines.append(
          f"| {rec['name']} | {masters} | {'bf16' if rec['mu_bf16'] else 'f32'} "
          f"| {_fmt(rec['argument_bytes_per_param'], '.2f')} | {rec['state_bytes_per_param']:.2f} "
          f"| {_fmt(None if temp is None else temp / 2**20, '.1f')} "
          f"| {rec['step_ms_median']:.2f} | {rec['vs_fp32']:.3f} "
          f"| {rec['vs_fp32_paired_median']:.3f} | {rec['cpu_ms_median']:.2f} "
          f"| {rec['cpu_vs_fp32']:.3f} |")
  if payload.get("float16_evidence"):
    lines += ["", "## Why not float16 masters", "",
              "RMS error after 1000 tiny updates / RMS drift (0 is exact, 1 is a stall); "
              "float64 reference:", "", float16_markdown(payload["float16_evidence"])]
  lines += ["", "Bars (step time vs fp32 masters):", ""]
  for bar in payload["bars"]:
    lines.append(f"- {bar['model']} {bar['variant']}: {bar['value']:.3f} <= {bar['limit']:.2f} "
                 f"{'PASS' if bar['passed'] else 'FAIL'}")
  return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = argparse.ArgumentParser(prog="python -m benchmarks.masters",
                              description="\n\n".join(__doc__.split("\n\n")[:2]),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=",".join(models.MODELS),
                 help="comma-separated subset of the models (default: %(default)s; --smoke: mlp)")
  p.add_argument("--variant", default=",".join(v.name for v in VARIANTS),
                 help="comma-separated subset of the variants, fp32 always included "
                      "(default: %(default)s; --smoke: fp32,bf16_stochastic,bf16_kahan)")
  p.add_argument("--preset", choices=("cpu", "gpu"), default=None,
                 help="model sizes (default: the default device's platform)")
  p.add_argument("--repeats", type=int, default=21,
                 help="interleaved timed repeats per variant (default: %(default)s; --smoke: 3)")
  p.add_argument("--inner", type=int, default=3,
                 help="steps per timed repeat (default: %(default)s; --smoke: 1)")
  p.add_argument("--warmup", type=int, default=3,
                 help="warm-up steps per variant (default: %(default)s; --smoke: 1)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny MLP, few repeats, written to a temp folder unless --out")
  p.add_argument("--out", type=pathlib.Path, default=None, help=report.OUT_HELP)
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  p.add_argument("--no-float16", action="store_true",
                 help="skip the float16-vs-bfloat16 storage comparison (about 10 s)")
  return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  """Parses and checks ``argv``; adds ``models`` and ``variants``."""
  p = build_parser()
  args = p.parse_args(argv)
  names = [m for m in args.model.split(",") if m]
  bad = [m for m in names if m not in models.MODELS]
  if bad or not names:
    p.error(f"--model must be a comma-separated subset of {models.MODELS}, got {args.model!r}")
  args.models = names
  known = {v.name: v for v in VARIANTS}
  chosen = {v for v in args.variant.split(",") if v} | {"fp32"}
  if chosen - set(known):
    p.error(f"--variant must be a comma-separated subset of {tuple(known)}, got {args.variant!r}")
  args.variants = [v for v in VARIANTS if v.name in chosen]
  for name in ("repeats", "inner"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.warmup < 0:
    p.error(f"--warmup must be >= 0, got {args.warmup}")
  if args.smoke:
    args.models, args.preset, args.repeats, args.inner, args.warmup = ["mlp"], "smoke", 3, 1, 1
    args.no_float16 = True
    args.variants = [v for v in args.variants if v.name in ("fp32", *BARRED)]
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  device = jax.devices()[0]
  platform_kind = "gpu" if device.platform == "gpu" else "cpu"
  preset = args.preset or platform_kind
  limit = BARS[platform_kind]
  out = report.output_dir(args.out, args.smoke)
  print(f"models {', '.join(args.models)} ({preset} sizes); variants "
        f"{', '.join(v.name for v in args.variants)}; {args.repeats} repeats x {args.inner} steps "
        f"on {device.device_kind}; results will be written to {out}", flush=True)
  results, bars = [], []
  for name in args.models:
    problem = models.build_problem(name, preset)
    result = bench_model(problem, args.variants, repeats=args.repeats, inner=args.inner,
                         warmup=args.warmup)
    results.append(result)
    bars += check_bars(result, limit)
  evidence = None
  if not args.no_float16:
    print("float16 vs bfloat16 storage: 1000 tiny updates at three weight scales")
    evidence = float16_evidence()
  payload = dict(
      meta=dict(command="python -m benchmarks.masters " + " ".join(sys.argv[1:] if argv is None else argv),
                date=datetime.date.today().isoformat(), platform=device.platform,
                device_kind=device.device_kind, machine=platform.machine(),
                jax=jax.__version__, optax=optax.__version__, preset=preset,
                repeats=args.repeats, inner=args.inner, warmup=args.warmup),
      results=results, bars=bars, float16_evidence=evidence)
  text = markdown(payload)
  print("\n" + text)
  stem = out / f"masters-{report.machine_name(device)}-{payload['meta']['date']}"
  report.write(payload, stem, text)
  print(f"wrote {stem}.json and {stem}.md")
  return 1 if args.strict and not all(b["passed"] for b in bars) else 0


if __name__ == "__main__":
  sys.exit(main())
