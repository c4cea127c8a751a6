"""Benchmarks jmp_lite against fp32, hand-written jmp and Flax DynamicScale.

Run ``python -m benchmarks.run --help``. Every variant trains the same model on
the same batch with the same Adam, is jitted with its state donated, is
compiled ahead of time, and is warmed up before timing. Variants are timed
interleaved (their order rotates each repeat), and the step time is the
median over repeats; each repeat times ``inner`` consecutive steps followed by
``block_until_ready``.

Variants (``--policy`` picks a subset):

  fp32_highest  GPU only: fp32 under ``jax.default_matmul_precision("highest")``.
  fp32          plain optax: grad, adam, apply (default matmul precision).
  bf16          jmp_lite ``make_train_step``, ``mixed_bfloat16``, Adam wrapped in
                ``static_loss_scaling(.., 1.0)`` (the cheap skip-on-non-finite).
  f16_dynamic   jmp_lite ``make_train_step``, ``mixed_float16``,
                ``dynamic_loss_scaling(adam)``.
  f16_noscale   the overhead baseline, written by hand with no loss scaling and
                no skip logic at all: cast to f16, grad, adam, apply.
  jmp_dynamic   the classic hand-written jmp step: ``jmp.DynamicLossScale``,
                scale, grad, unscale, ``all_finite``, ``adjust``, ``select_tree``
                over params and optimizer state.
  flax_dynamic  ``flax.training.dynamic_scale.DynamicScale.value_and_grad``,
                then ``jnp.where`` over params and optimizer state.

The three dynamic-scaling variants use the same init scale (2**15), growth
interval (2000), factors (2, 0.5), model, f16 policy and Adam.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from benchmarks import models

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"

VARIANTS = (
    "fp32_highest",
    "fp32",
    "bf16",
    "f16_dynamic",
    "f16_noscale",
    "jmp_dynamic",
    "flax_dynamic",
)
LABELS = {
    "fp32_highest": "fp32, precision=highest (optax)",
    "fp32": "fp32 (optax)",
    "bf16": "jmp_lite bf16",
    "f16_dynamic": "jmp_lite f16 + dynamic scaling",
    "f16_noscale": "f16, no scaling (hand-written)",
    "jmp_dynamic": "jmp f16 + dynamic (hand-written)",
    "flax_dynamic": "Flax DynamicScale f16",
}

LEARNING_RATE = 1e-3
INIT_SCALE = 2.0**15
GROWTH_INTERVAL = 2000

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) from vendor data sheets,
# matched by substring of ``device.device_kind``; more specific names first.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("V100", 125.0),  # fp16 tensor cores; V100 has no bf16.
)

# (ratio key, limit, models it applies to or None for all, description)
CPU_BARS = (
    ("overhead", 1.03, None, "f16_dynamic / f16_noscale (dynamic-scaling overhead)"),
    ("vs_jmp", 1.00, None, "f16_dynamic / jmp_dynamic (jmp_lite vs hand-written jmp)"),
    ("vs_flax", 1.00, None, "f16_dynamic / flax_dynamic (jmp_lite vs Flax DynamicScale)"),
)
GPU_BARS = (
    ("bf16_vs_fp32_highest", 1 / 3, ("transformer", "lstm"), "bf16 / fp32 highest (step time)"),
    ("bf16_vs_fp32", 1 / 1.5, ("transformer", "lstm"), "bf16 / fp32 default (step time)"),
    ("bf16_temp_vs_fp32", 0.6, ("cnn", "transformer", "lstm"), "bf16 / fp32 temp memory"),
)


def bf16_peak_tflops(device_kind: str) -> float | None:
  """The dense bf16 peak for a GPU name, or None if unknown.

  Examples:
    >>> bf16_peak_tflops("NVIDIA H100 80GB HBM3")
    989.0
    >>> bf16_peak_tflops("cpu") is None
    True
  """
  for name, peak in BF16_PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return None


# --------------------------------------------------------------------------- #
# Variants
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Variant:
  """One way of writing the train step.

  Attributes:
    name: the key in :data:`VARIANTS`.
    fn: the jitted ``step(state, batch) -> (state, out)``, state donated.
    init: returns a fresh state (its own copy of the initial params).
    scale_of: the current loss scale in a state, or None (no scaling).
  """

  name: str
  fn: Callable[[Any, Any], Any]
  init: Callable[[], Any]
  scale_of: Callable[[Any], Any] | None = None


def _copy(tree: Any) -> Any:
  return jax.tree.map(jnp.array, tree)


def _cast_floating(tree: Any, dtype: Any) -> Any:
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )


def _plain_step(loss_fn, tx, compute_dtype=None, precision=None):
  """fp32 (compute_dtype None) or the hand-written f16 step without scaling."""

  def step(state, batch):
    params, opt_state = state
    if compute_dtype is not None:
      batch = _cast_floating(batch, compute_dtype)

    def f(p):
      if compute_dtype is not None:
        p = _cast_floating(p, compute_dtype)
      return loss_fn(p, batch).astype(jnp.float32)

    if precision is None:
      loss, grads = jax.value_and_grad(f)(params)
    else:
      with jax.default_matmul_precision(precision):
        loss, grads = jax.value_and_grad(f)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def _jmp_step(loss_fn, tx):
  """The classic hand-written jmp pattern (jmp's README / examples).

  The scale travels as two arrays and is rebuilt into a ``jmp.DynamicLossScale``
  inside the step: jmp 0.0.4's pytree flattening breaks ``jit(...).lower()``
  on current JAX, which the compiled-memory measurement needs.
  """
  import jmp  # pylint: disable=import-outside-toplevel

  policy = jmp.get_policy("params=float32,compute=float16,output=float32")

  def step(state, batch):
    params, opt_state, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter, period=GROWTH_INTERVAL, factor=2)
    batch = policy.cast_to_compute(batch)

    def f(p):
      loss = policy.cast_to_output(loss_fn(policy.cast_to_compute(p), batch))
      return loss_scale.scale(loss), loss

    grads, loss = jax.grad(f, has_aux=True)(params)
    grads = loss_scale.unscale(policy.cast_to_param(grads))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
        finite, (new_params, new_opt_state), (params, opt_state)
    )
    return (params, opt_state, (loss_scale.loss_scale, loss_scale.counter)), loss

  def init_scale():
    return (jnp.asarray(INIT_SCALE, jnp.float32), jnp.zeros((), jnp.int32))

  return step, init_scale


def _flax_step(loss_fn, tx):
  """Flax's DynamicScale pattern (flax.training.dynamic_scale docstring)."""

  def step(state, batch):
    params, opt_state, dyn_scale = state
    batch = _cast_floating(batch, jnp.float16)

    def f(p):
      return loss_fn(_cast_floating(p, jnp.float16), batch).astype(jnp.float32)

    dyn_scale, finite, loss, grads = dyn_scale.value_and_grad(f)(params)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = functools.partial(jnp.where, finite)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    return (params, opt_state, dyn_scale), loss

  def init_scale():
    from flax.training import dynamic_scale  # pylint: disable=import-outside-toplevel

    return dynamic_scale.DynamicScale(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=GROWTH_INTERVAL,
        fin_steps=jnp.zeros((), jnp.int32),
        scale=jnp.asarray(INIT_SCALE, jnp.float32),
    )

  return step, init_scale


def make_variant(name: str, problem: models.Problem) -> Variant:
  """Builds variant ``name`` (see :data:`VARIANTS`) for ``problem``."""
  import jmp_lite  # pylint: disable=import-outside-toplevel

  tx = optax.adam(LEARNING_RATE)
  params = problem.params
  jit = functools.partial(jax.jit, donate_argnums=(0,))

  def plain_init():
    p = _copy(params)
    return (p, tx.init(p))

  if name in ("fp32", "fp32_highest", "f16_noscale"):
    step = _plain_step(
        problem.loss_fn,
        tx,
        compute_dtype=jnp.float16 if name == "f16_noscale" else None,
        precision="highest" if name == "fp32_highest" else None,
    )
    return Variant(name, jit(step), plain_init)
  if name in ("bf16", "f16_dynamic"):
    if name == "bf16":
      policy = jmp_lite.get_policy("mixed_bfloat16")
      lib_tx = jmp_lite.static_loss_scaling(tx, 1.0)
    else:
      policy = jmp_lite.get_policy("mixed_float16")
      lib_tx = jmp_lite.dynamic_loss_scaling(
          tx, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
      )
    return Variant(
        name,
        jmp_lite.make_train_step(problem.loss_fn, policy),  # jitted, donates the state
        lambda: jmp_lite.TrainState.create(params=_copy(params), tx=lib_tx),
        lambda s: jmp_lite.loss_scale_of(s.opt_state),
    )
  if name in ("jmp_dynamic", "flax_dynamic"):
    step, init_scale = (_jmp_step if name == "jmp_dynamic" else _flax_step)(
        problem.loss_fn, tx
    )

    def init():
      p, opt_state = plain_init()
      return (p, opt_state, init_scale())

    if name == "jmp_dynamic":
      scale_of = lambda s: s[2][0]  # noqa: E731
    else:
      scale_of = lambda s: s[2].scale  # noqa: E731
    return Variant(name, jit(step), init, scale_of)
  raise ValueError(f"variant must be one of {VARIANTS}, got {name!r}")


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _Live:
  variant: Variant
  compiled: Any
  state: Any
  times: list[float]
  record: dict[str, Any]
  cpu_times: list[float] = dataclasses.field(default_factory=list)


def _memory(compiled: Any) -> dict[str, int | None]:
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it.
    m = None
  if m is None:
    return dict(argument=None, output=None, alias=None, temp=None, total=None)
  arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
  return dict(argument=arg, output=out, alias=alias, temp=temp, total=arg + out - alias + temp)


def _flops(lowered: Any) -> float | None:
  try:
    cost = lowered.cost_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it.
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  return float(cost["flops"])


def _scale_value(variant: Variant, state: Any) -> float | None:
  return None if variant.scale_of is None else float(variant.scale_of(state))


def _prepare(variant: Variant, batch: Any, warmup: int) -> _Live:
  state = variant.init()
  t0 = time.perf_counter()
  lowered = variant.fn.lower(state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  for _ in range(warmup):
    state, out = compiled(state, batch)
  jax.block_until_ready((state, out))
  record = dict(
      name=variant.name,
      label=LABELS.get(variant.name, variant.name),
      lower_s=t1 - t0,
      compile_s=t2 - t1,
      memory_bytes=_memory(compiled),
      flops=_flops(lowered),
      loss_after_warmup=float(out["loss"] if isinstance(out, dict) else out),
      loss_scale_before=_scale_value(variant, state),
  )
  return _Live(variant, compiled, state, [], record)


def _time_once(live: _Live, batch: Any, inner: int) -> float:
  """Wall time per step over ``inner`` steps; appends CPU time per step to ``live``."""
  state = live.state
  c0 = time.process_time()
  t0 = time.perf_counter()
  for _ in range(inner):
    state, out = live.compiled(state, batch)
  jax.block_until_ready((state, out))
  elapsed = time.perf_counter() - t0
  live.cpu_times.append((time.process_time() - c0) / inner)
  live.state = state
  return elapsed / inner


def _median_ratio(a: list[float], b: list[float]) -> float:
  return statistics.median(a) / statistics.median(b)


def _ratios(records: dict[str, dict[str, Any]], times: dict[str, list[float]]) -> dict[str, Any]:
  """Time and memory ratios; pairs whose variants did not run are left out."""
  out: dict[str, Any] = {}

  def time_ratio(key, num, den):
    if num in times and den in times:
      out[key] = _median_ratio(times[num], times[den])
      # Per-repeat ratios of neighbours in the interleaved schedule, robust to drift.
      out[key + "_paired_median"] = statistics.median(
          x / y for x, y in zip(times[num], times[den])
      )
      out[key + "_of_mins"] = min(times[num]) / min(times[den])

  def mem_ratio(key, num, den, kind):
    a = records.get(num, {}).get("memory_bytes", {}).get(kind)
    b = records.get(den, {}).get("memory_bytes", {}).get(kind)
    if a is not None and b:
      out[key] = a / b

  for name in VARIANTS:
    if name != "fp32":
      time_ratio(f"{name}_vs_fp32", name, "fp32")
      mem_ratio(f"{name}_temp_vs_fp32", name, "fp32", "temp")
      mem_ratio(f"{name}_total_vs_fp32", name, "fp32", "total")
  time_ratio("overhead", "f16_dynamic", "f16_noscale")
  time_ratio("vs_jmp", "f16_dynamic", "jmp_dynamic")
  time_ratio("vs_flax", "f16_dynamic", "flax_dynamic")
  time_ratio("bf16_vs_fp32_highest", "bf16", "fp32_highest")
  return out


def _check_bars(model: str, ratios: dict[str, Any], on_gpu: bool) -> list[dict[str, Any]]:
  bars = []
  for key, limit, only, what in CPU_BARS + (GPU_BARS if on_gpu else ()):
    if only is not None and model not in only:
      continue
    value = ratios.get(key)
    if value is None:
      continue
    bars.append(
        dict(
            model=model,
            bar=key,
            what=what,
            value=value,
            limit=limit,
            passed=bool(value <= limit),
            scope="gpu" if (key, limit, only, what) in GPU_BARS else "cpu",
        )
    )
  return bars


def bench_model(
    problem: models.Problem,
    names: list[str],
    *,
    repeats: int,
    warmup: int,
    target_s: float,
    on_gpu: bool,
    peak_tflops: float | None,
    peaks: dict[str, int | None],
    progress: Any,
) -> dict[str, Any]:
  """Compiles, warms up and times every variant in ``names`` interleaved."""
  lives = []
  for name in names:
    progress.set_postfix_str(f"{problem.name}: compile {name}")
    lives.append(_prepare(make_variant(name, problem), problem.batch, warmup))
    progress.update(1)

  # Steps per timed sample, so that a sample lasts about target_s.
  single = [_time_once(live, problem.batch, 1) for live in lives]
  inner = max(1, min(200, round(target_s / statistics.median(single))))

  progress.set_postfix_str(f"{problem.name}: timing x{inner}")
  for r in range(repeats):
    k = r % len(lives)
    for live in lives[k:] + lives[:k]:  # rotate the order every repeat
      live.times.append(_time_once(live, problem.batch, inner))
      progress.update(1)

  records: dict[str, dict[str, Any]] = {}
  times: dict[str, list[float]] = {}
  for live in lives:
    rec, ts = live.record, live.times
    med = statistics.median(ts)
    cpu = live.cpu_times[-len(ts):]  # drop the calibration call
    rec.update(
        step_s=dict(median=med, min=min(ts), max=max(ts), samples=ts),
        # Process CPU time per step (all threads): less sensitive than wall time
        # to other processes on a shared machine.
        cpu_s=dict(median=statistics.median(cpu), samples=cpu),
        examples_per_s=problem.examples / med,
        loss_scale_after=_scale_value(live.variant, live.state),
        peak_bytes=peaks.get(live.variant.name),
    )
    # A changed scale means steps were skipped (growth needs 2000 steps), which
    # would make a variant do less work: flag it.
    rec["skipped_during_timing"] = (
        None
        if rec["loss_scale_before"] is None
        else rec["loss_scale_after"] < rec["loss_scale_before"]
    )
    if rec["flops"] is not None:
      rec["tflops_per_s"] = rec["flops"] / med / 1e12
      rec["bf16_peak_fraction"] = (
          rec["tflops_per_s"] / peak_tflops if peak_tflops else None
      )
    records[live.variant.name] = rec
    times[live.variant.name] = ts
  ratios = _ratios(records, times)
  cpu_ratios = _ratios(records, {n: r["cpu_s"]["samples"] for n, r in records.items()})
  ratios.update(
      {f"{k}_cpu_time": cpu_ratios[k] for k in ("overhead", "vs_jmp", "vs_flax") if k in cpu_ratios}
  )
  return dict(
      model=problem.name,
      config=problem.config,
      examples_per_step=problem.examples,
      inner_steps_per_sample=inner,
      repeats=repeats,
      variants=records,
      ratios=ratios,
      bars=_check_bars(problem.name, ratios, on_gpu),
  )


# --------------------------------------------------------------------------- #
# Peak device memory (GPU): one fresh process per variant, since the
# allocator's peak can't be reset within a process.
# --------------------------------------------------------------------------- #


def _probe_peak(args: argparse.Namespace) -> None:
  model, name = args.probe_peak.split(":")
  problem = _problem(model, args)
  live = _prepare(make_variant(name, problem), problem.batch, warmup=2)
  stats = jax.devices()[0].memory_stats()
  del live
  print(json.dumps({"peak_bytes": None if not stats else stats.get("peak_bytes_in_use")}))


def _measure_peaks(model: str, names: list[str], argv: list[str]) -> dict[str, int | None]:
  peaks: dict[str, int | None] = {}
  for name in names:
    cmd = [sys.executable, "-m", "benchmarks.run", *argv, "--probe-peak", f"{model}:{name}"]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=pathlib.Path(__file__).resolve().parent.parent
    )
    try:
      peaks[name] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]
    except (IndexError, ValueError, KeyError):
      print(f"peak-memory probe failed for {model}:{name}:\n{proc.stderr[-2000:]}", file=sys.stderr)
      peaks[name] = None
  return peaks


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def _mb(x: int | None) -> str:
  return "n/a" if x is None else f"{x / 2**20:.1f}"


def _fmt(x: float | None, spec: str = ".3f") -> str:
  return "n/a" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
  """The Markdown report: one table per model, ratios, and the bars."""
  meta = result["meta"]
  lines = [
      f"Device: **{meta['device_kind']}** ({meta['platform']}), jax {meta['versions']['jax']}, "
      f"{meta['date']}. Command: `{meta['command']}`",
      "",
  ]
  for m in result["models"]:
    cfg = ", ".join(f"{k}={v}" for k, v in m["config"].items())
    lines += [
        f"**{m['model']}** ({cfg}); {m['repeats']} interleaved repeats x "
        f"{m['inner_steps_per_sample']} steps; time median [min, max].",
        "",
        "| variant | step ms | examples/s | time vs fp32 | compile s | temp MiB | "
        "total MiB | temp vs fp32 | peak MiB | TFLOP/s | bf16 peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fp32 = m["variants"].get("fp32")
    for name, v in m["variants"].items():
      st, mem = v["step_s"], v["memory_bytes"]
      t_rel = st["median"] / fp32["step_s"]["median"] if fp32 else None
      temp_rel = (
          mem["temp"] / fp32["memory_bytes"]["temp"]
          if fp32 and mem["temp"] is not None and fp32["memory_bytes"]["temp"]
          else None
      )
      frac = v.get("bf16_peak_fraction")
      lines.append(
          f"| {v['label']} | {st['median'] * 1e3:.2f} [{st['min'] * 1e3:.2f}, "
          f"{st['max'] * 1e3:.2f}] | {v['examples_per_s']:.0f} | {_fmt(t_rel)} | "
          f"{v['lower_s'] + v['compile_s']:.2f} | {_mb(mem['temp'])} | {_mb(mem['total'])} | "
          f"{_fmt(temp_rel)} | {_mb(v['peak_bytes'])} | {_fmt(v.get('tflops_per_s'), '.2f')} | "
          f"{'n/a' if frac is None else f'{frac:.1%}'} |"
      )
    r = m["ratios"]
    parts = [
        f"{k} {r[k]:.3f} (paired {r[k + '_paired_median']:.3f}, CPU time {r[k + '_cpu_time']:.3f})"
        for k in ("overhead", "vs_jmp", "vs_flax")
        if k in r
    ]
    if parts:
      lines += ["", "Ratios of median wall time: " + "; ".join(parts) + "."]
    lines.append("")
  lines += ["| bar | model | value | limit | result |", "|---|---|---|---|---|"]
  for b in result["bars"]:
    lines.append(
        f"| {b['what']} | {b['model']} | {b['value']:.3f} | <= {b['limit']:.3f} | "
        f"{'PASS' if b['passed'] else 'FAIL'} |"
    )
  return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Step time and temp memory per variant, relative to fp32, one group per model."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  model_names = [m["model"] for m in result["models"]]
  names = [n for n in VARIANTS if any(n in m["variants"] for m in result["models"])]
  width = 0.8 / max(1, len(names))
  for i, name in enumerate(names):
    xs, t_rel, t_err, mem_rel = [], [], [[], []], []
    for j, m in enumerate(result["models"]):
      v, fp32 = m["variants"].get(name), m["variants"].get("fp32")
      if v is None or fp32 is None:
        continue
      base = fp32["step_s"]["median"]
      med = v["step_s"]["median"] / base
      xs.append(j + (i - (len(names) - 1) / 2) * width)
      t_rel.append(med)
      t_err[0].append(med - v["step_s"]["min"] / base)
      t_err[1].append(v["step_s"]["max"] / base - med)
      a, b = v["memory_bytes"]["temp"], fp32["memory_bytes"]["temp"]
      mem_rel.append(a / b if a is not None and b else math.nan)
    axes[0].bar(xs, t_rel, width, yerr=t_err, capsize=2, label=LABELS[name])
    axes[1].bar(xs, mem_rel, width, label=LABELS[name])
  for ax, title in zip(
      axes, ("step time / fp32 (median, min-max)", "compiled temp memory / fp32")
  ):
    ax.set_xticks(range(len(model_names)), model_names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(title)
  axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  fig.suptitle(f"{result['meta']['device_kind']}: {result['meta']['command']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _machine_name(device: Any) -> str:
  if device.platform == "cpu":
    return f"cpu-{platform.machine()}"
  kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
  return "-".join(p for p in kind.split("-") if p)


def _versions() -> dict[str, str]:
  out = {}
  for mod in ("jax", "jaxlib", "flax", "optax", "jmp", "jmp_lite", "numpy"):
    try:
      out[mod] = str(__import__(mod).__version__)
    except (ImportError, AttributeError):
      out[mod] = "n/a"
  return out


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from e
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
  return value


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.run",
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Variants: " + ", ".join(VARIANTS),
  )
  p.add_argument(
      "--model",
      choices=(*models.MODELS, "all"),
      help="default: all (--smoke: mlp)",
  )
  p.add_argument(
      "--policy",
      default="all",
      help="comma-separated variants to run (default all; fp32_highest only on GPU): "
      + ",".join(VARIANTS),
  )
  p.add_argument("--batch", type=_positive_int, help="batch size (default: the device preset)")
  p.add_argument("--layers", type=_positive_int, help="depth: MLP/Transformer/LSTM layers")
  p.add_argument(
      "--hidden", type=_positive_int, help="width: MLP width, d_model, LSTM hidden, CNN channels"
  )
  p.add_argument(
      "--steps", type=_positive_int, default=41, help="timed repeats per variant (default 41)"
  )
  p.add_argument("--warmup", type=_positive_int, default=3, help="warm-up steps (default 3)")
  p.add_argument(
      "--sample-seconds",
      type=float,
      default=0.1,
      help="target length of one timed sample; sets the steps per sample (default 0.1)",
  )
  p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
  p.add_argument(
      "--out", type=pathlib.Path, help="output folder (default benchmarks/results; --smoke: a temp dir)"
  )
  p.add_argument("--smoke", action="store_true", help="tiny models, 3 repeats: a CI check")
  p.add_argument("--no-peak", action="store_true", help="skip the GPU peak-memory probes")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  p.add_argument("--probe-peak", help=argparse.SUPPRESS)
  return p


def _problem(model: str, args: argparse.Namespace) -> models.Problem:
  preset = "smoke" if args.smoke else args.device
  return models.build_problem(
      model, preset, batch=args.batch, layers=args.layers, hidden=args.hidden
  )


def _variant_names(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
  if args.policy == "all":
    names = [n for n in VARIANTS if args.device == "gpu" or n != "fp32_highest"]
  else:
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
      parser.error(f"--policy: unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    names = [n for n in VARIANTS if n in names]  # canonical order
  return names


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args = parser.parse_args(argv)
  if args.sample_seconds <= 0:
    parser.error(f"--sample-seconds must be > 0, got {args.sample_seconds!r}")
  if args.device == "cpu":
    jax.config.update("jax_platforms", "cpu")
  if args.probe_peak:
    _probe_peak(args)
    return 0
  names = _variant_names(args, parser)
  model = args.model or ("mlp" if args.smoke else "all")
  model_names = list(models.MODELS) if model == "all" else [model]
  if args.smoke:
    args.steps, args.warmup, args.sample_seconds = min(args.steps, 3), 1, 0.0

  # GPU peak memory: fresh processes, before this one takes the device.
  peaks: dict[str, dict[str, int | None]] = {m: {} for m in model_names}
  if args.device == "gpu" and not args.no_peak:
    probe_argv = [a for a in argv if a != "--strict"]
    for m in model_names:
      peaks[m] = _measure_peaks(m, names, probe_argv)

  device = jax.devices()[0]
  if args.device == "gpu" and device.platform != "gpu":
    parser.error(f"--device gpu, but JAX's default device is {device} ({device.platform})")
  peak_tflops = bf16_peak_tflops(device.device_kind) if device.platform == "gpu" else None

  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

  total = len(model_names) * len(names) * (1 + args.steps)
  results = []
  with tqdm(total=total, desc="benchmarks", unit="run", file=sys.stderr) as progress:
    for m in model_names:
      problem = _problem(m, args)
      results.append(
          bench_model(
              problem,
              names,
              repeats=args.steps,
              warmup=args.warmup,
              target_s=max(args.sample_seconds, 1e-9),
              on_gpu=device.platform == "gpu",
              peak_tflops=peak_tflops,
              peaks=peaks[m],
              progress=progress,
          )
      )
      del problem

  now = datetime.datetime.now(datetime.timezone.utc)
  command = "python -m benchmarks.run" + ("" if not argv else " " + shlex.join(argv))
  result = dict(
      meta=dict(
          command=command,
          date=now.strftime("%Y-%m-%d"),
          time_utc=now.isoformat(timespec="seconds"),
          platform=device.platform,
          device_kind=device.device_kind,
          device_memory_stats_reported=device.memory_stats() is not None,
          bf16_peak_tflops=peak_tflops,
          cpu_count=os.cpu_count(),
          machine=platform.machine(),
          processor=platform.processor(),
          python=platform.python_version(),
          versions=_versions(),
          smoke=args.smoke,
          learning_rate=LEARNING_RATE,
          init_scale=INIT_SCALE,
          growth_interval=GROWTH_INTERVAL,
          variants={n: LABELS[n] for n in names},
      ),
      models=results,
      bars=[b for r in results for b in r["bars"]],
  )
  result["all_bars_pass"] = all(b["passed"] for b in result["bars"])

  out_dir = args.out or (
      pathlib.Path(tempfile.mkdtemp(prefix="jmp_lite_bench_")) if args.smoke else RESULTS_DIR
  )
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = out_dir / f"{_machine_name(device)}-{result['meta']['date']}"
  report = markdown(result)
  stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
  stem.with_suffix(".md").write_text(report)
  plot(result, stem.with_suffix(".png"))

  print(report)
  for b in result["bars"]:
    print(
        f"{'PASS' if b['passed'] else 'FAIL'}  {b['model']:<11} {b['what']}: "
        f"{b['value']:.3f} (limit {b['limit']:.3f})"
    )
  skipped = [
      f"{m['model']}:{n}" for m in results for n, v in m["variants"].items()
      if v["skipped_during_timing"]
  ]
  if skipped:
    print(f"WARNING: steps were skipped during timing in {skipped}", file=sys.stderr)
  print(f"wrote {stem}.json, .md and .png")
  return 1 if args.strict and not result["all_bars_pass"] else 0


if __name__ == "__main__":
  sys.exit(main())
