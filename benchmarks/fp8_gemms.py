"""Counts the GEMMs that XLA compiled a train step's matmuls into, bf16 against FP8.

Run ``python -m benchmarks.fp8_gemms --help``. The script builds the benchmark
model (default: the Transformer), compiles the ``bf16_autocast`` and
``bf16_fp8`` train steps of ``benchmarks/variants.py`` and counts, in each
optimised HLO program, the matmuls by what runs them: cuBLASLt's FP8 GEMM
(the ``__cublas$lt$matmul$f8`` custom call), another cuBLAS GEMM custom call,
or a plain HLO ``dot`` (what XLA:CPU runs, and what a GPU falls back to when
the FP8 rewrite does not match). Both steps run the same matmuls, so their
totals should agree.

Issue 23's GPU check is ``fp8_fraction`` (FP8 GEMMs over all GEMMs and dots of
the FP8 step) equal to 1. On a CPU it is 0: XLA:CPU has no FP8 GEMM and runs
the quantise-dequantise graph as written.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from benchmarks import cli
from benchmarks import models
from benchmarks import report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.fp8_gemms"
VARIANTS = ("bf16_autocast", "bf16_fp8")
FP8_GEMM = "__cublas$lt$matmul$f8"
# Matches an optimised-HLO ``dot(`` instruction and a cuBLAS custom-call target.
_DOT = re.compile(r"= [^=]*\bdot\(")
_CUBLAS = re.compile(r'custom_call_target="(__cublas\$[^"]*)"')


def count_gemms(hlo_text: str) -> dict[str, int]:
  """Matmuls in an optimised HLO module's text, by what runs them.

  Args:
    hlo_text: ``compiled.as_text()``.

  Returns:
    ``{"fp8_gemm": n, "other_cublas": n, "hlo_dot": n}``.

  Examples:
    >>> text = '''
    ...   %a = f32[2,2] dot(f32[2,2] %x, f32[2,2] %y), lhs_contracting_dims={1}
    ...   %b = (bf16[4,4], s8[0]) custom-call(%p, %q), custom_call_target="__cublas$lt$matmul$f8"
    ...   %c = (bf16[4,4], s8[0]) custom-call(%p, %q), custom_call_target="__cublas$gemm"
    ... '''
    >>> count_gemms(text)
    {'fp8_gemm': 1, 'other_cublas': 1, 'hlo_dot': 1}
  """
  targets = _CUBLAS.findall(hlo_text)
  return dict(
      fp8_gemm=sum(t == FP8_GEMM for t in targets),
      other_cublas=sum(t != FP8_GEMM for t in targets),
      hlo_dot=len(_DOT.findall(hlo_text)),
  )


def count_step(name: str, problem: models.Problem) -> dict[str, Any]:
  """Lowers and compiles variant ``name`` on ``problem`` and counts its matmuls."""
  variant = variants_lib.make_variant(name, problem)
  lowered = variant.fn.lower(variant.init(), problem.batch)
  counts = count_gemms(lowered.compile().as_text())
  all_gemms = sum(counts.values())
  return dict(
      counts,
      name=name,
      all=all_gemms,
      fp8_fraction=counts["fp8_gemm"] / all_gemms if all_gemms else 0.0,
  )


def markdown(result: dict[str, Any]) -> str:
  """The report: one row per variant."""
  lines = [
      report.meta_line(result["meta"]),
      "",
      f"Model `{result['model']}`, config {result['config']}.",
      "",
      "| variant | matmuls | FP8 GEMMs | other cuBLAS | HLO dots | FP8 fraction |",
      "|---|---|---|---|---|---|",
  ]
  for r in result["rows"]:
    lines.append(
        f"| {r['name']} | {r['all']} | {r['fp8_gemm']} | {r['other_cublas']} | "
        f"{r['hlo_dot']} | {r['fp8_fraction']:.2f} |"
    )
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Variants: " + ", ".join(VARIANTS))
  p.add_argument("--model", choices=models.MODELS, default="transformer",
                 help="the model (default: %(default)s)")
  cli.add_common_arguments(p, "the smoke-sized model: a CI check", variants=False)
  p.add_argument("--hidden", type=cli.positive_int,
                 help="d_model or width (default: the preset's; 2048 for the issue 23 run)")
  p.add_argument("--layers", type=cli.positive_int, help="depth (default: the preset's)")
  p.add_argument("--batch", type=cli.positive_int, help="batch size (default: the preset's)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Builds, compiles and counts; writes ``fp8-gemms-<machine>-<date>.{json,md}``."""
  argv = sys.argv[1:] if argv is None else argv
  p = build_parser()
  args = p.parse_args(argv)
  cli.select_platform(args)
  device = cli.device(args, p)
  preset = "smoke" if args.smoke else args.device
  problem = models.build_problem(args.model, preset, batch=args.batch, layers=args.layers,
                                 hidden=args.hidden)
  result = dict(
      meta=report.meta(cli.command(PROG, argv), device, args=cli.args_record(args)),
      model=args.model,
      config=problem.config,
      rows=[count_step(name, problem) for name in VARIANTS],
  )
  stem = report.output_dir(args.out, args.smoke) / (
      f"fp8-gemms-{report.machine_name(device)}-{result['meta']['date']}"
  )
  report.publish(result, stem, markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
