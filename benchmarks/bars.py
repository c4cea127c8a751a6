"""The bars the benchmarks check: each a measured ratio and the largest value that passes.

:data:`CPU_BARS` apply on every device; :data:`GPU_BARS` are added on a GPU.
``benchmarks.run`` checks them per model with :func:`check_bars`; the other
scripts build their own with :func:`bar`.
"""

from __future__ import annotations

from typing import Any

# Steps dispatched back to back, without waiting, by ``measure.dispatch_fraction``
# (the host-sync bar's description names it).
DISPATCH_STEPS = 100

# (ratio key, limit, models it applies to or None for all, description)
CPU_BARS = (
    ("overhead", 1.03, None, "f16_dynamic / f16_noscale (dynamic-scaling overhead)"),
    ("vs_jmp", 1.00, None, "f16_dynamic / jmp_dynamic (jmp_lite vs hand-written jmp)"),
    ("vs_flax", 1.00, None, "f16_dynamic / flax_dynamic (jmp_lite vs Flax DynamicScale)"),
    # Issue 13: the skip may not hold an extra copy of the gradients.
    (
        "temp_overhead",
        1.05,
        ("mlp", "deep_transformer"),
        "f16_dynamic / f16_noscale compiled temp memory",
    ),
)
GPU_BARS = (
    # Issue 13: on a GPU the skip costs at most 2%, and never a host sync per step.
    ("overhead", 1.02, None, "f16_dynamic / f16_noscale (dynamic-scaling overhead, GPU)"),
    # No host sync per step: the host runs as many steps ahead of the device as
    # it does for the step without scaling. A fraction of the steps' run time,
    # compared with a fixed limit, measures the runtime's queue: on an H200 every
    # step, fp32 without scaling too, dispatches 100 steps in 0.93 of their time.
    (
        "dispatch_ahead",
        2.0,
        None,
        f"steps run ahead of the device out of {DISPATCH_STEPS}: f16_noscale's / f16_dynamic's",
    ),
    ("bf16_vs_fp32_highest", 1 / 3, ("transformer", "lstm"), "bf16 / fp32 highest (step time)"),
    ("bf16_vs_fp32", 1 / 1.5, ("transformer", "lstm"), "bf16 / fp32 default (step time)"),
    ("bf16_temp_vs_fp32", 0.6, ("cnn", "transformer", "lstm"), "bf16 / fp32 temp memory"),
    # Issue 23: FP8 GEMMs at least 1.3x faster than bf16 (run at d_model >= 2048).
    (
        "fp8_vs_bf16_autocast",
        1 / 1.3,
        ("transformer", "deep_transformer"),
        "bf16 + FP8 / bf16 autocast (step time, GPU)",
    ),
)

def bar(name: str, what: str, value: float, limit: float, meaningful: bool, **extra: Any):
  """One checked bar: ``value <= limit``.

  Args:
    name: the bar's key.
    what: what it compares, for people.
    value: the measured ratio (or seconds).
    limit: the largest value that passes.
    meaningful: False for smoke-sized runs, whose timings are noise.
    **extra: more fields (the model, the scope...).

  Returns:
    A dict with ``bar``, ``what``, ``value``, ``limit``, ``passed``,
    ``meaningful`` and ``extra``.

  Examples:
    >>> b = bar("overhead", "a / b", 1.01, 1.03, True)
    >>> b["passed"], b["meaningful"]
    (True, True)
  """
  return dict(
      extra,
      bar=name,
      what=what,
      value=value,
      limit=limit,
      passed=bool(value <= limit),
      meaningful=meaningful,
  )


def check_bars(
    model: str, model_ratios: dict[str, Any], on_gpu: bool, meaningful: bool = True
) -> list[dict[str, Any]]:
  """The :data:`CPU_BARS` (and on a GPU the :data:`GPU_BARS`) that apply to ``model``.

  Bars whose ratio was not measured are left out.
  """
  bars = []
  for key, limit, only, what in CPU_BARS + (GPU_BARS if on_gpu else ()):
    if only is not None and model not in only:
      continue
    value = model_ratios.get(key)
    if value is None:
      continue
    scope = "gpu" if (key, limit, only, what) in GPU_BARS else "cpu"
    bars.append(bar(key, what, value, limit, meaningful, model=model, scope=scope))
  return bars
