"""Benchmark reports: run metadata, bar lines, Markdown tables, plots and files.

``markdown`` and ``plot`` render the result of ``python -m benchmarks.run``;
``meta``, ``bar_status``, ``bar_line`` and ``write`` serve every benchmark
script.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import tempfile
from typing import Any, Callable

from benchmarks import measure
from benchmarks import variants as variants_lib

# Where results go by default: out/ at the repository root, which git ignores.
# The committed results are regenerated with an explicit ``--out benchmarks/results``.
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent.parent / "out"
OUT_HELP = ("output folder (default: out/ at the repository root, which git ignores; "
            "with --smoke a new temp folder; pass --out benchmarks/results to regenerate "
            "the committed results)")
SMOKE_STATUS = "SMOKE (not meaningful)"


def mib(x: int | None) -> str:
  """Bytes as MiB with one decimal (``n/a`` for ``None``), as every benchmark table prints them."""
  return "n/a" if x is None else f"{x / 2**20:.1f}"


def _fmt(x: float | None, spec: str = ".3f") -> str:
  return "n/a" if x is None else format(x, spec)


def bar_status(b: dict[str, Any]) -> str:
  """``PASS``, ``FAIL``, or :data:`SMOKE_STATUS` for a bar that is not meaningful.

  Examples:
    >>> bar_status(dict(passed=False, meaningful=True))
    'FAIL'
    >>> bar_status(dict(passed=False, meaningful=False))
    'SMOKE (not meaningful)'
  """
  if not b["meaningful"]:
    return SMOKE_STATUS
  return "PASS" if b["passed"] else "FAIL"


def bar_line(b: dict[str, Any]) -> str:
  """One printed line for a bar: status, where, what, value and limit."""
  where = b.get("model") or b.get("case", "")
  return f"{bar_status(b)}  {where:<11} {b['what']}: {b['value']:.3f} (limit {b['limit']:.3f})"


def bars_status(bars: list[dict[str, Any]], strict: bool) -> int:
  """Prints each bar's line; the exit status: 1 if ``strict`` and a meaningful bar failed."""
  for b in bars:
    print(bar_line(b))
  failed = any(not b["passed"] and b["meaningful"] for b in bars)
  return 1 if strict and failed else 0


def bars_table(bars: list[dict[str, Any]], where: str = "model") -> list[str]:
  """The Markdown lines of a table of bars; ``where`` names the column of ``b[where]``."""
  lines = [f"| bar | {where} | value | limit | result |", "|---|---|---|---|---|"]
  for b in bars:
    lines.append(
        f"| {b['what']} | {b[where]} | {b['value']:.3f} | <= {b['limit']:.3f} | {bar_status(b)} |"
    )
  return lines


def markdown(result: dict[str, Any]) -> str:
  """The Markdown report of a run: one table per model, ratios, and the bars."""
  lines = [meta_line(result["meta"]), ""]
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
    for v in m["variants"].values():
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
          f"{v['lower_s'] + v['compile_s']:.2f} | {mib(mem['temp'])} | {mib(mem['total'])} | "
          f"{_fmt(temp_rel)} | {mib(v['peak_bytes'])} | {_fmt(v.get('tflops_per_s'), '.2f')} | "
          f"{'n/a' if frac is None else f'{frac:.1%}'} |"
      )
    r = m["ratios"]
    parts = [
        f"{k} {r[k]:.3f} (paired {r[k + '_paired_median']:.3f}, CPU time {r[k + '_cpu_time']:.3f})"
        for k in measure.PAIR_RATIOS
        if k in r
    ]
    if parts:
      lines += ["", "Ratios of median wall time: " + "; ".join(parts) + "."]
    lines.append("")
  lines += bars_table(result["bars"])
  return "\n".join(lines) + "\n"


def pyplot():
  """matplotlib's pyplot on the non-interactive Agg backend."""
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  return plt


def save_figure(fig: Any, result: dict[str, Any], path: pathlib.Path) -> None:
  """Titles ``fig`` with the device and command, saves it to ``path`` and closes it."""
  fig.suptitle(f"{result['meta']['device_kind']}: {result['meta']['command']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  pyplot().close(fig)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  """Step time and temp memory per variant, relative to fp32, one group per model."""
  fig, axes = pyplot().subplots(1, 2, figsize=(13, 4.5))
  model_names = [m["model"] for m in result["models"]]
  names = [n for n in variants_lib.VARIANTS if any(n in m["variants"] for m in result["models"])]
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
    label = variants_lib.LABELS[name]
    axes[0].bar(xs, t_rel, width, yerr=t_err, capsize=2, label=label)
    axes[1].bar(xs, mem_rel, width, label=label)
  for ax, title in zip(
      axes, ("step time / fp32 (median, min-max)", "compiled temp memory / fp32")
  ):
    ax.set_xticks(range(len(model_names)), model_names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(title)
  axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  save_figure(fig, result, path)


def machine_name(device: Any) -> str:
  """``cpu-<arch>`` on a CPU, else the device kind as a lower-case slug."""
  if device.platform == "cpu":
    return f"cpu-{platform.machine()}"
  kind = "".join(c if c.isalnum() else "-" for c in device.device_kind.lower())
  return "-".join(p for p in kind.split("-") if p)


def versions() -> dict[str, str]:
  """The versions of the libraries that the benchmarks use."""
  out = {}
  for mod in ("jax", "jaxlib", "flax", "optax", "jmp", "jmp_lite", "numpy"):
    try:
      out[mod] = str(__import__(mod).__version__)
    except (ImportError, AttributeError):
      out[mod] = "n/a"
  return out


def meta(command: str, device: Any, **extra: Any) -> dict[str, Any]:
  """What ran where: the command, date, device, machine and library versions.

  Args:
    command: the command line, as a string.
    device: the JAX device that ran it.
    **extra: more fields, appended.

  Returns:
    A JSON-ready dict.
  """
  now = datetime.datetime.now(datetime.timezone.utc)
  return dict(
      command=command,
      date=now.strftime("%Y-%m-%d"),
      time_utc=now.isoformat(timespec="seconds"),
      platform=device.platform,
      device_kind=device.device_kind,
      device_memory_stats_reported=device.memory_stats() is not None,
      cpu_count=os.cpu_count(),
      # Fewer than cpu_count under ``taskset``; what XLA:CPU may actually use.
      usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      machine=platform.machine(),
      processor=platform.processor(),
      python=platform.python_version(),
      versions=versions(),
      **extra,
  )


def meta_line(m: dict[str, Any]) -> str:
  """The first line of a Markdown report: device, jax version, date and command."""
  return (
      f"Device: **{m['device_kind']}** ({m['platform']}), jax {m['versions']['jax']}, "
      f"{m['date']}. Command: `{m['command']}`"
  )


def output_dir(out: pathlib.Path | None, smoke: bool) -> pathlib.Path:
  """``out`` if given, else a new temp dir for a smoke run, else :data:`DEFAULT_OUT`; created."""
  if out is None:
    out = pathlib.Path(tempfile.mkdtemp(prefix="jmp_lite_bench_")) if smoke else DEFAULT_OUT
  out.mkdir(parents=True, exist_ok=True)
  return out


def write(
    result: dict[str, Any],
    stem: pathlib.Path,
    text: str,
    plot_fn: Callable[[dict[str, Any], pathlib.Path], None] | None = None,
) -> None:
  """Writes ``stem.json`` (``result``), ``stem.md`` (``text``) and, with ``plot_fn``, ``stem.png``."""
  stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
  stem.with_suffix(".md").write_text(text)
  if plot_fn is not None:
    plot_fn(result, stem.with_suffix(".png"))


def publish(result: dict[str, Any], stem: pathlib.Path, text: str) -> None:
  """Writes ``stem.json`` and ``stem.md`` and prints the markdown and where it went."""
  write(result, stem, text)
  print()
  print(text)
  print(f"wrote {stem}.json and .md")
