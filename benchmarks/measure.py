"""How the benchmarks measure a train step, compare variants and check bars.

Each variant is lowered and compiled ahead of time (both timed), warmed up,
then timed interleaved with the others: every repeat times ``inner``
consecutive steps of each variant followed by ``block_until_ready``, and the
order of the variants rotates each repeat. The step time is the median over
repeats. Compiled memory comes from ``memory_analysis()`` and FLOPs from
``cost_analysis()``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax

from benchmarks import bars as bars_lib
from benchmarks import models
from benchmarks import variants as variants_lib

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

# Steps dispatched back to back, without waiting, by :func:`dispatch_fraction`.
DISPATCH_STEPS = bars_lib.DISPATCH_STEPS

# Time ratios of one variant to another (not to fp32) that the report prints,
# with their CPU-time ratios.
PAIR_RATIOS = ("overhead", "vs_jmp", "vs_flax", "autocast_vs_dynamic", "fp8_vs_bf16_autocast")

# The most steps one timed sample may hold.
MAX_INNER = 200


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


@dataclasses.dataclass
class Live:
  """A compiled, warmed-up variant being timed.

  Attributes:
    variant: the variant.
    compiled: its compiled step.
    state: its current state (each call donates it and returns the next).
    times: wall time per step of each timed sample, in seconds.
    record: what is known about it so far (see :func:`prepare`).
    cpu_times: process CPU time per step of each timed sample, in seconds.
    check: called with the step's last output after each timed sample (to
      raise if, say, the step skipped), or None.
  """

  variant: Any  # a variants_lib.Variant, or another benchmark's variant with a name
  compiled: Any
  state: Any
  times: list[float]
  record: dict[str, Any]
  cpu_times: list[float] = dataclasses.field(default_factory=list)
  check: Callable[[Any], None] | None = None


def memory_bytes(compiled: Any) -> dict[str, int | None]:
  """Argument, output, alias, temp and total bytes of a compiled computation.

  ``total`` is ``argument + output - alias + temp``. Every value is None where
  the backend has no ``memory_analysis``.
  """
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it.
    m = None
  if m is None:
    return dict(argument=None, output=None, alias=None, temp=None, total=None)
  arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
  return dict(argument=arg, output=out, alias=alias, temp=temp, total=arg + out - alias + temp)


def flops(lowered: Any) -> float | None:
  """XLA's FLOP count of a lowered computation, or None if it gives none."""
  try:
    cost = lowered.cost_analysis()
  except Exception:  # noqa: BLE001 - some backends do not implement it.
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  return float(cost["flops"])


def scale_value(variant: variants_lib.Variant, state: Any) -> float | None:
  """The loss scale in ``state`` as a float, or None for a variant without one."""
  return None if variant.scale_of is None else float(variant.scale_of(state))


def prepare(variant: variants_lib.Variant, batch: Any, warmup: int) -> Live:
  """Lowers and compiles ``variant`` (timing both), then runs ``warmup`` steps.

  The record holds ``name``, ``label``, ``lower_s``, ``compile_s``,
  ``memory_bytes``, ``flops``, ``loss_after_warmup`` and ``loss_scale_before``.
  """
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
      label=variants_lib.LABELS.get(variant.name, variant.name),
      lower_s=t1 - t0,
      compile_s=t2 - t1,
      memory_bytes=memory_bytes(compiled),
      flops=flops(lowered),
      loss_after_warmup=float(out["loss"] if isinstance(out, dict) else out),
      loss_scale_before=scale_value(variant, state),
  )
  return Live(variant, compiled, state, [], record)


def time_once(live: Live, batch: Any, inner: int) -> float:
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
  if live.check is not None:
    live.check(out)
  return elapsed / inner


def calibrate(lives: list[Live], batch: Any, target_s: float) -> int:
  """Steps per timed sample, so that a sample lasts about ``target_s``.

  Times one step of each variant (not kept as a sample) and returns a count
  between 1 and :data:`MAX_INNER`.
  """
  single = [time_once(live, batch, 1) for live in lives]
  for live in lives:
    live.cpu_times.clear()
  return max(1, min(MAX_INNER, round(target_s / statistics.median(single))))


def time_interleaved(
    lives: list[Live], batch: Any, repeats: int, inner: int, progress: Any = None
) -> None:
  """Appends ``repeats`` samples of ``inner`` steps to each live's ``times``.

  The variants take turns, and their order rotates every repeat, so that drift
  on a shared machine spreads over all of them. ``progress.update(1)`` (a tqdm
  bar, say) is called after each sample if ``progress`` is given.
  """
  for r in range(repeats):
    k = r % len(lives)
    for live in lives[k:] + lives[:k]:
      live.times.append(time_once(live, batch, inner))
      if progress is not None:
        progress.update(1)


def time_calls(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
  """Seconds per call of each of ``calls``, interleaved like :func:`time_interleaved`.

  For work that is not a compiled step (tracing, say). Each call's result is
  passed to ``jax.block_until_ready``; the order of the calls rotates every
  repeat.

  Args:
    calls: name -> a function of no arguments.
    repeats: how many times to call each.

  Returns:
    name -> the ``repeats`` durations, in seconds.

  Examples:
    >>> times = time_calls({"a": lambda: 1, "b": lambda: 2}, repeats=3)
    >>> sorted(times), [len(t) for t in times.values()]
    (['a', 'b'], [3, 3])
  """
  times: dict[str, list[float]] = {k: [] for k in calls}
  names = list(calls)
  for r in range(repeats):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      t0 = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(time.perf_counter() - t0)
  return times


def dispatch_fraction(live: Live, batch: Any, steps: int = DISPATCH_STEPS) -> dict[str, Any]:
  """How long ``steps`` steps take to dispatch, against how long they take to run.

  Calls the step ``steps`` times back to back without waiting for results,
  then waits for the last state. JAX dispatches asynchronously, so a step whose
  device work outlasts its dispatch returns control early, and the fraction is
  small. A step that makes the host wait for the device every time (a
  ``lax.cond`` whose predicate XLA reads back to the host, say) cannot run
  ahead: the loop lasts as long as the work, and the fraction is close to 1.

  Args:
    live: a compiled, warmed-up variant (its state is advanced).
    batch: the batch.
    steps: how many steps to dispatch.

  Returns:
    ``steps``, ``dispatch_s`` (the loop), ``total_s`` (loop and wait) and
    ``fraction`` (their ratio).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> live = Live("v", jax.jit(lambda s, b: (s + b, s)), jnp.zeros(()), [], {})
    >>> d = dispatch_fraction(live, 1.0, steps=3)
    >>> float(live.state), 0 < d["fraction"] <= 1
    (3.0, True)
  """
  state = jax.block_until_ready(live.state)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, out = live.compiled(state, batch)
  t1 = time.perf_counter()
  jax.block_until_ready((state, out))
  t2 = time.perf_counter()
  live.state = state
  return dict(steps=steps, dispatch_s=t1 - t0, total_s=t2 - t0, fraction=(t1 - t0) / (t2 - t0))


def steps_ahead(dispatch: dict[str, Any]) -> float:
  """How many steps the host ran ahead of the device, from :func:`dispatch_fraction`'s record.

  The loop of ``steps`` calls ends ``total_s - dispatch_s`` before the device
  does, that is ``steps * (1 - fraction)`` steps early. A runtime that queues a
  bounded number of steps holds it near that bound; a step whose host waits for
  the device each time holds it below 1.

  Examples:
    >>> round(steps_ahead(dict(steps=100, dispatch_s=0.75, total_s=1.0, fraction=0.75)), 6)
    25.0
  """
  return dispatch["steps"] * (1.0 - dispatch["fraction"])


def finish_record(live: Live) -> dict[str, Any]:
  """Adds the timings and the loss scale after timing to ``live.record``.

  Adds ``step_s`` (median, min, max, samples), ``cpu_s`` (median, samples),
  ``loss_scale_after`` and ``skipped_during_timing``: whether the scale fell
  while timing, which means steps were skipped and the variant did less work
  (None for a variant without a scale).

  Returns:
    The record.
  """
  rec, ts = live.record, live.times
  rec.update(
      step_s=dict(median=statistics.median(ts), min=min(ts), max=max(ts), samples=ts),
      # Process CPU time per step (all threads): less sensitive than wall time
      # to other processes on a shared machine.
      cpu_s=dict(median=statistics.median(live.cpu_times), samples=live.cpu_times),
      loss_scale_after=scale_value(live.variant, live.state),
  )
  # Growth needs 2000 steps, so a changed scale can only mean a skipped step.
  rec["skipped_during_timing"] = (
      None
      if rec["loss_scale_before"] is None
      else rec["loss_scale_after"] < rec["loss_scale_before"]
  )
  return rec


def compare(a: list[float], b: list[float]) -> dict[str, float]:
  """Ratios of two variants' interleaved samples ``a`` and ``b``.

  Returns:
    ``median``: median(a) / median(b); ``paired_median``: the median of the
    per-repeat ratios of neighbours in the interleaved schedule, robust to
    drift; ``of_mins``: min(a) / min(b).

  Examples:
    >>> compare([1.0, 3.0, 2.0], [4.0, 4.0, 5.0])
    {'median': 0.5, 'paired_median': 0.4, 'of_mins': 0.25}
  """
  return dict(
      median=statistics.median(a) / statistics.median(b),
      paired_median=statistics.median(x / y for x, y in zip(a, b)),
      of_mins=min(a) / min(b),
  )


def ratios(records: dict[str, dict[str, Any]], times: dict[str, list[float]]) -> dict[str, Any]:
  """Time and memory ratios; pairs whose variants did not run are left out.

  Args:
    records: variant name -> record (with ``memory_bytes``).
    times: variant name -> per-sample times (wall or CPU).

  Returns:
    ``{key: ratio}``; time ratios also give ``key + "_paired_median"`` and
    ``key + "_of_mins"`` (see :func:`compare`).
  """
  out: dict[str, Any] = {}

  def time_ratio(key, num, den):
    if num in times and den in times:
      c = compare(times[num], times[den])
      out[key] = c["median"]
      out[key + "_paired_median"] = c["paired_median"]
      out[key + "_of_mins"] = c["of_mins"]

  def mem_ratio(key, num, den, kind):
    a = records.get(num, {}).get("memory_bytes", {}).get(kind)
    b = records.get(den, {}).get("memory_bytes", {}).get(kind)
    if a is not None and b:
      out[key] = a / b

  for name in variants_lib.VARIANTS:
    if name != "fp32":
      time_ratio(f"{name}_vs_fp32", name, "fp32")
      mem_ratio(f"{name}_temp_vs_fp32", name, "fp32", "temp")
      mem_ratio(f"{name}_total_vs_fp32", name, "fp32", "total")
  time_ratio("overhead", "f16_dynamic", "f16_noscale")
  mem_ratio("temp_overhead", "f16_dynamic", "f16_noscale", "temp")
  time_ratio("vs_jmp", "f16_dynamic", "jmp_dynamic")
  time_ratio("vs_flax", "f16_dynamic", "flax_dynamic")
  time_ratio("autocast_vs_dynamic", "f16_autocast", "f16_dynamic")
  time_ratio("fp8_vs_bf16_autocast", "bf16_fp8", "bf16_autocast")  # A GPU bar only.
  time_ratio("bf16_vs_fp32_highest", "bf16", "fp32_highest")
  dispatch = {n: records.get(n, {}).get("dispatch") for n in ("f16_dynamic", "f16_noscale")}
  if dispatch["f16_dynamic"] is not None:
    out["dispatch_fraction"] = dispatch["f16_dynamic"]["fraction"]
    if dispatch["f16_noscale"] is not None:
      out["dispatch_ahead"] = steps_ahead(dispatch["f16_noscale"]) / max(
          steps_ahead(dispatch["f16_dynamic"]), 1e-9)
  return out


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
    meaningful: bool = True,
) -> dict[str, Any]:
  """Compiles, warms up and times every variant in ``names`` interleaved.

  Args:
    problem: the model, its params, batch and loss.
    names: the variants, from :data:`benchmarks.variants.VARIANTS`.
    repeats: timed samples per variant.
    warmup: warm-up steps per variant.
    target_s: about how long one timed sample lasts.
    on_gpu: whether the GPU bars apply.
    peak_tflops: the device's bf16 peak, or None.
    peaks: variant -> peak device bytes measured elsewhere (may be empty).
    progress: a tqdm bar (``update``, ``set_postfix_str``).
    meaningful: whether the bars mean anything (False for smoke sizes).

  Returns:
    The model's result: its config, a record per variant, ratios and bars.
  """
  lives = []
  for name in names:
    progress.set_postfix_str(f"{problem.name}: compile {name}")
    lives.append(prepare(variants_lib.make_variant(name, problem), problem.batch, warmup))
    progress.update(1)
  inner = calibrate(lives, problem.batch, target_s)
  progress.set_postfix_str(f"{problem.name}: timing x{inner}")
  time_interleaved(lives, problem.batch, repeats, inner, progress)

  records: dict[str, dict[str, Any]] = {}
  for live in lives:
    if on_gpu:  # on two CPU cores, 100 steps of every variant would take minutes
      progress.set_postfix_str(f"{problem.name}: dispatch {live.variant.name}")
      live.record["dispatch"] = dispatch_fraction(live, problem.batch)
    rec = finish_record(live)
    med = rec["step_s"]["median"]
    rec.update(examples_per_s=problem.examples / med, peak_bytes=peaks.get(live.variant.name))
    if rec["flops"] is not None:
      rec["tflops_per_s"] = rec["flops"] / med / 1e12
      rec["bf16_peak_fraction"] = rec["tflops_per_s"] / peak_tflops if peak_tflops else None
    records[live.variant.name] = rec
  model_ratios = ratios(records, {n: r["step_s"]["samples"] for n, r in records.items()})
  cpu_ratios = ratios(records, {n: r["cpu_s"]["samples"] for n, r in records.items()})
  model_ratios.update(
      {f"{k}_cpu_time": cpu_ratios[k] for k in PAIR_RATIOS if k in cpu_ratios}
  )
  return dict(
      model=problem.name,
      config=problem.config,
      examples_per_step=problem.examples,
      inner_steps_per_sample=inner,
      repeats=repeats,
      variants=records,
      ratios=model_ratios,
      bars=bars_lib.check_bars(problem.name, model_ratios, on_gpu, meaningful),
  )


def device_peak_bytes(variant: variants_lib.Variant, batch: Any) -> int | None:
  """The device's peak bytes in use after compiling and running ``variant``.

  The allocator's peak cannot be reset, so call this once per fresh process.
  None where the device reports no memory stats (CPU).
  """
  live = prepare(variant, batch, warmup=2)
  stats = jax.devices()[0].memory_stats()
  del live
  return None if not stats else stats.get("peak_bytes_in_use")
