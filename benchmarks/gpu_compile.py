"""Compiles the benchmark train steps for an NVIDIA H100 that this machine does not have.

Run ``python -m benchmarks.gpu_compile --help``. XLA's GPU compiler can build
the program an H100 would run without the GPU ("deviceless" ahead-of-time
compilation), from a target description that ships with jmp_lite. For each
model and train-step variant of ``benchmarks/variants.py`` the script compiles
the step with ``jmp.compile_for_gpu`` (its shapes placed on a one-GPU topology
mesh) and reports:

- every GEMM, by what runs it (cuBLASLt FP8, cuBLASLt, cuBLAS, a Triton GEMM,
  cuDNN, XLA's own loops) and its operand dtypes (``jmp.compile_for_gpu``'s census);
- the convolutions by runner and dtype;
- the temp, argument, output and alias bytes of ``compiled.memory_analysis()``,

under XLA's default flags and with ``--xla_gpu_enable_triton_gemm=false``
(cuBLAS for every GEMM), and checks the bars below. It needs the CUDA plugin,
which a CPU machine can install (``pip install -e '.[gpu]'``, about 5.6 GB);
no GPU, driver or CUDA install is needed. What a compile proves: which kernels
the program holds and how much memory it asks for. What it cannot prove:
speed (nothing runs), and autotuned choices (no autotuning without a GPU).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

# First: on a machine without a GPU driver it sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK
# before JAX starts, so that the CUDA plugin's compiler stays up (see conftest.py).
from jmp_lite._src.diagnostics import gpu_compile as gpu_lib  # noqa: E402

from benchmarks import bars as bars_lib  # noqa: E402  (after the environment is set)
from benchmarks import cli  # noqa: E402
from benchmarks import hlo_census  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks import report  # noqa: E402

PROG = "python -m benchmarks.gpu_compile"
TARGETS = gpu_lib.GPU_TARGETS
FLAG_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-triton-gemm": {"xla_gpu_enable_triton_gemm": False},
}
VARIANTS = ("fp32", "fp32_step", "bf16", "f16_dynamic", "bf16_lean", "bf16_autocast", "bf16_fp8",
            "bf16_fp8_rowwise",
            "f16_noscale", "jmp_dynamic", "flax_dynamic")
SMOKE_VARIANTS = ("bf16", "bf16_fp8", "jmp_dynamic")
PLUGIN_HINT = gpu_lib.PLUGIN_HINT
plugin_missing = gpu_lib.plugin_missing


def require_plugin(p: argparse.ArgumentParser) -> None:
  """Exits with ``p``'s usage error, saying what to install, if the CUDA plugin is missing."""
  missing = plugin_missing()
  if missing:
    p.error(missing)


def measure(name: str, problem: models.Problem, target: str, options: dict[str, Any]) -> dict[str, Any]:
  """Compiles variant ``name`` for ``target`` and reads its memory and its GEMM/convolution census."""
  import jax  # pylint: disable=import-outside-toplevel
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel
  from benchmarks import variants as variants_lib  # pylint: disable=import-outside-toplevel

  variant = variants_lib.make_variant(name, problem)
  start = time.perf_counter()
  compiled = jmp.compile_for_gpu(variant.fn, jax.eval_shape(variant.init), problem.batch,
                                 target=target, compiler_options=options)
  seconds = time.perf_counter() - start
  return dict(
      variant=name,
      compile_s=seconds,
      temp_bytes=compiled.temp_bytes,
      argument_bytes=compiled.argument_bytes,
      output_bytes=compiled.output_bytes,
      alias_bytes=compiled.alias_bytes,
      **hlo_census.summary(list(compiled.ops)),
  )


# (what, numerator variant, denominator variant or None, limit, models or None for all, flags)
# A "fraction" bar has no denominator: its value is the share of the GEMMs that are not FP8.
BARS = (
    ("f16_dynamic / jmp_dynamic temp memory", "f16_dynamic", "jmp_dynamic", 1.02, None, "default"),
    ("bf16 / jmp_dynamic temp memory", "bf16", "jmp_dynamic", 1.02, None, "default"),
    ("bf16_lean / bf16 temp memory (bf16 masters)", "bf16_lean", "bf16", 1.0, None, "default"),
    ("bf16_fp8 / bf16_autocast temp memory", "bf16_fp8", "bf16_autocast", 1.0, ("transformer",),
     "default"),
    ("bf16_autocast / bf16 temp memory", "bf16_autocast", "bf16", 1.02, ("cnn", "transformer"),
     "default"),
    ("bf16_fp8: GEMMs not on float8 operands (share)", "bf16_fp8", None, 0.0, None, "default"),
    ("bf16_fp8: GEMMs not on float8 operands (share)", "bf16_fp8", None, 0.0, None,
     "no-triton-gemm"),
    ("bf16_fp8_rowwise: GEMMs not on float8 operands (share)", "bf16_fp8_rowwise", None, 0.0,
     None, "default"),
    ("bf16_fp8_rowwise: GEMMs not on float8 operands (share)", "bf16_fp8_rowwise", None, 0.0,
     None, "no-triton-gemm"),
)


def check_bars(rows: list[dict[str, Any]], meaningful: bool) -> list[dict[str, Any]]:
  """The bars whose variants were compiled, each with its value and PASS/FAIL.

  Examples:
    >>> rows = [dict(model="mlp", flags="default", variant=v, temp_bytes=t, fp8_fraction=f)
    ...         for v, t, f in [("bf16", 100, 0.0), ("jmp_dynamic", 100, 0.0), ("bf16_fp8", 90, 1.0)]]
    >>> [(b["what"], b["value"], b["passed"]) for b in check_bars(rows, True)]
    [('bf16 / jmp_dynamic temp memory', 1.0, True), ('bf16_fp8: GEMMs not on float8 operands (share)', 0.0, True)]
  """
  index = {(r["model"], r["flags"], r["variant"]): r for r in rows}
  found = []
  for what, num, den, limit, scope, flags in BARS:
    for model in dict.fromkeys(r["model"] for r in rows):
      if scope is not None and model not in scope:
        continue
      a, b = index.get((model, flags, num)), index.get((model, flags, den)) if den else None
      if a is None or (den is not None and b is None):
        continue
      value = a["temp_bytes"] / b["temp_bytes"] if b is not None else 1.0 - a["fp8_fraction"]
      found.append(bars_lib.bar("gpu_compile", what, value, limit, meaningful, model=model,
                                flags=flags))
  return found


def _kinds(kinds: dict[str, int]) -> str:
  return ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"


SUMMARY_VARIANTS = ("jmp_dynamic", "f16_dynamic", "bf16", "bf16_lean", "fp32", "fp32_step",
                    "bf16_autocast", "bf16_fp8", "bf16_fp8_rowwise")


def summary_tables(result: dict[str, Any]) -> list[str]:
  """Two Markdown tables: temp memory per model (default flags), and the FP8 steps' GEMMs."""
  index = {(r["model"], r["flags"], r["variant"]): r for r in result["rows"]}
  model_names = list(dict.fromkeys(r["model"] for r in result["rows"]))
  present = [v for v in SUMMARY_VARIANTS if any((m, "default", v) in index for m in model_names)]
  lines = ["Temp MiB of one compiled step (XLA's default flags):", "",
           "| model | " + " | ".join(present) + " |", "|---" * (len(present) + 1) + "|"]
  for m in model_names:
    cells = [report.mib(index[m, "default", v]["temp_bytes"]) if (m, "default", v) in index else "n/a"
             for v in present]
    lines.append(f"| {m} | " + " | ".join(cells) + " |")
  fp8 = [v for v in ("bf16_fp8", "bf16_fp8_rowwise") if v in present]
  if fp8:
    lines += ["", "The FP8 steps' GEMMs, by runner and operand dtypes:", "",
              "| model | variant | flags | GEMMs | on float8 | by runner |", "|---|---|---|---|---|---|"]
    for m in model_names:
      for v in fp8:
        for flags in FLAG_SETS:
          r = index.get((m, flags, v))
          if r is not None:
            lines.append(f"| {m} | {v} | {flags} | {r['gemms']} | {r['fp8_gemms']} | "
                         f"{_kinds(r['gemm_kinds'])} |")
  return lines + [""]


def markdown(result: dict[str, Any]) -> str:
  """The report: the summary, one table per model and flag set, then the bars."""
  lines = [report.meta_line(result["meta"]), "",
           f"**Compiled for an {result['target_device']}, not run** (target `{result['target']}`): "
           "the kernels and memory of the program XLA would run there. Nothing was timed.", ""]
  lines += summary_tables(result)
  groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
  for r in result["rows"]:
    groups.setdefault((r["model"], r["flags"]), []).append(r)
  for (model, flags), rows in groups.items():
    config = ", ".join(f"{k}={v}" for k, v in result["configs"][model].items())
    lines += [f"**{model}** ({config}), flags `{flags}`.", "",
              "| variant | temp MiB | argument MiB | output MiB | alias MiB | GEMMs | FP8 share "
              "| GEMMs by runner and operand dtypes | convolutions |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
      lines.append(
          f"| {r['variant']} | {report.mib(r['temp_bytes'])} | {report.mib(r['argument_bytes'])} | "
          f"{report.mib(r['output_bytes'])} | {report.mib(r['alias_bytes'])} | {r['gemms']} | "
          f"{r['fp8_fraction']:.2f} | {_kinds(r['gemm_kinds'])} | {_kinds(r['conv_kinds'])} |")
    lines.append("")
  if result["bars"]:
    lines += ["| bar | model | flags | value | limit | result |", "|---|---|---|---|---|---|"]
    lines += [f"| {b['what']} | {b['model']} | {b['flags']} | {b['value']:.3f} | <= {b['limit']:.3f} "
              f"| {report.bar_status(b)} |" for b in result["bars"]]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Variants: " + ", ".join(VARIANTS) + ". Flag sets: "
                 + ", ".join(f"{k} {v or '(XLA defaults)'}" for k, v in FLAG_SETS.items()))
  p.add_argument("--model", default="all", metavar="LIST",
                 help=f"comma-separated models of {', '.join(models.MODELS)}, or all "
                      f"({', '.join(models.DEFAULT_MODELS)}; default: %(default)s)")
  p.add_argument("--variants", default="all", metavar="LIST",
                 help="comma-separated variants (listed below), or all (default: %(default)s)")
  p.add_argument("--flags", default="all", metavar="LIST",
                 help="comma-separated flag sets (listed below), or all (default: %(default)s)")
  p.add_argument("--target", default="h100", choices=tuple(TARGETS),
                 help="the GPU to compile for (default: %(default)s)")
  p.add_argument("--preset", default="gpu", choices=("gpu", "cpu"),
                 help="model sizes (default: %(default)s, the sizes of the GPU benchmarks)")
  p.add_argument("--hidden", type=cli.positive_int, help="width (default: the preset's)")
  p.add_argument("--layers", type=cli.positive_int, help="depth (default: the preset's)")
  p.add_argument("--batch", type=cli.positive_int, help="batch size (default: the preset's)")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true",
                 help=f"smoke-sized models and the variants {','.join(SMOKE_VARIANTS)}: a CI check")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  return p


def main(argv: list[str] | None = None) -> int:
  """Compiles, counts and writes ``gpu-compile-<target>-<date>.{json,md}``."""
  argv = sys.argv[1:] if argv is None else argv
  p = build_parser()
  args = p.parse_args(argv)
  require_plugin(p)
  names = cli.choose(args.model, models.MODELS, models.DEFAULT_MODELS, "model")
  variants = cli.choose(args.variants, VARIANTS, SMOKE_VARIANTS if args.smoke else VARIANTS,
                        "variant")
  flag_sets = cli.choose(args.flags, tuple(FLAG_SETS), tuple(FLAG_SETS), "flag set")
  device = gpu_lib.topology_sharding(args.target).mesh.devices.flat[0]
  rows, configs = [], {}
  for name in names:
    problem = models.build_problem(name, "smoke" if args.smoke else args.preset, batch=args.batch,
                                   layers=args.layers, hidden=args.hidden)
    configs[name] = problem.config
    for flags in flag_sets:
      for variant in variants:
        row = dict(model=name, flags=flags, **measure(variant, problem, args.target, FLAG_SETS[flags]))
        print(f"{name:12s} {flags:15s} {variant:14s} temp {report.mib(row['temp_bytes']):>9s} MiB  "
              f"FP8 share {row['fp8_fraction']:.2f}  {_kinds(row['gemm_kinds'])}", flush=True)
        rows.append(row)
  bars = check_bars(rows, meaningful=not args.smoke)
  meta = report.meta(cli.command(PROG, argv), CompiledFor(device), args=cli.args_record(args))
  result = dict(meta=meta, target=args.target, target_device=device.device_kind, configs=configs,
                rows=rows, bars=bars)
  stem = report.output_dir(args.out, args.smoke) / f"gpu-compile-{args.target}-{meta['date']}"
  report.publish(result, stem, markdown(result))
  return report.bars_status(bars, args.strict)


class CompiledFor:
  """What ``report.meta`` reads of a device, for a device that is compiled for, not present."""

  platform = "cuda (compiled only)"

  def __init__(self, device: Any) -> None:
    self.device_kind = device.device_kind

  def memory_stats(self) -> None:
    return None


if __name__ == "__main__":
  sys.exit(main())
