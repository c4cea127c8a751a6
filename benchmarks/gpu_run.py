"""One command for a lent GPU: the measurements that need one, most important first, within a budget.

Run ``PYTHONPATH=. python -m benchmarks.gpu_run --out benchmarks/results`` from
the repository root on a machine whose JAX already has CUDA (nothing to
install: ``jmp`` is not needed). It measures, in this order:

1. the bf16 and f16 steps against fp32 on the Transformer, then on the CNN
   (step time and temp memory);
2. FP8 against bf16 autocast on a Transformer whose GEMMs are all at least
   4096 in every dimension (d_model 4096, 4096 tokens a batch), where FP8
   should pay;
3. the skip's overhead: the f16 step with dynamic loss scaling against a
   hand-written f16 step without scaling, and the host-sync check
   (``dispatch_ahead``: how many steps the host runs ahead of the device, against
   the step without scaling);
4. the quantised optimizer state (``jmp.quantize_state(optax.adamw(...),
   format=...)``, int8 and int4) against ``optax.adamw``: only where this jmp_lite has
   ``quantize_state``, otherwise the item says so and is skipped;
5. autocast against the policy (bf16 and f16).

Each item compiles its variants, warms them up and times them interleaved
(``benchmarks/measure.py``), and the JSON and Markdown results are rewritten
after every item, so a run cut off by the machine's time limit still leaves
everything measured so far. Before starting an item the command checks what is
left of ``--budget`` against the item's estimate (scaled by how far the items
so far overran theirs) and skips the rest when it would not fit. An item that
fails is recorded with its error, and the next one starts; the exit status is
then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
import traceback
from typing import Any, Callable

import jmp_lite  # noqa: F401  (first: without a GPU driver it keeps the CUDA plugin's check quiet)

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.gpu_run"
DEFAULT_BUDGET_S = 520.0  # the six items took 469 s on an H200 (2026-11-28)
# FP8 pays from GEMMs of about 4096 in all three sizes (docs/fp8.md): d_model
# 4096 (MLP 16384) and batch x seq = 8 x 512 = 4096 tokens.
FP8_SIZES = dict(hidden=4096, layers=2, batch=8)
# Later estimates grow by how far the items so far overran theirs, up to this factor.
MAX_OVERRUN = 3.0


@dataclasses.dataclass(frozen=True)
class Item:
  """One measurement: variants of one model, timed together.

  Attributes:
    name: the item's key in the results.
    what: what it answers, for people.
    model: the model of ``benchmarks/models.py``.
    variants: the variants of ``benchmarks/variants.py`` (or, for the
      quantised-state item, built here).
    pairs: ``(ratio key, numerator, denominator)`` to report.
    estimate_s: its seconds at GPU sizes, compiles included (measured on an H200).
    sizes: size overrides of the GPU preset.
  """

  name: str
  what: str
  model: str
  variants: tuple[str, ...]
  pairs: tuple[tuple[str, str, str], ...]
  estimate_s: float
  sizes: dict[str, int] = dataclasses.field(default_factory=dict)


ITEMS = (
    Item("half_vs_fp32_transformer", "bf16 and f16 steps vs fp32, Transformer", "transformer",
         ("fp32", "bf16", "f16_dynamic"),
         (("bf16_vs_fp32", "bf16", "fp32"), ("f16_dynamic_vs_fp32", "f16_dynamic", "fp32")), 60),
    Item("half_vs_fp32_cnn", "bf16 and f16 steps vs fp32, CNN", "cnn",
         ("fp32", "bf16", "f16_dynamic"),
         (("bf16_vs_fp32", "bf16", "fp32"), ("f16_dynamic_vs_fp32", "f16_dynamic", "fp32")), 35),
    Item("fp8_vs_bf16_autocast", "FP8 vs bf16 autocast, Transformer with GEMMs >= 4096",
         "transformer", ("bf16_autocast", "bf16_fp8", "bf16_fp8_amaxes"),
         (("fp8_vs_bf16_autocast", "bf16_fp8", "bf16_autocast"),
          # The weights' amaxes read from the state instead of reduced first (issue 44).
          ("fp8_state_amaxes_vs_fp8", "bf16_fp8_amaxes", "bf16_fp8")), 220, FP8_SIZES),
    Item("skip_overhead", "the skip's overhead: f16 + dynamic scaling vs f16 without scaling",
         "transformer", ("f16_dynamic", "f16_noscale"),
         (("overhead", "f16_dynamic", "f16_noscale"),), 40),
    Item("quantized_state", "int8 and int4 optimizer state (jmp.quantize_state) vs optax.adamw",
         "transformer", ("adamw", "adamw_int8", "adamw_int4"),
         (("int8_vs_adamw", "adamw_int8", "adamw"), ("int4_vs_adamw", "adamw_int4", "adamw")), 75),
    Item("autocast_vs_policy", "autocast vs the policy alone, bf16 and f16", "transformer",
         ("bf16", "bf16_autocast", "f16_dynamic", "f16_autocast"),
         (("bf16_autocast_vs_bf16", "bf16_autocast", "bf16"),
          ("f16_autocast_vs_f16", "f16_autocast", "f16_dynamic")), 70),
)


@dataclasses.dataclass(frozen=True)
class Settings:
  """How hard to time: repeats, warm-up steps, seconds per sample, model preset."""

  preset: str
  repeats: int
  warmup: int
  sample_s: float


GPU_SETTINGS = Settings("gpu", repeats=5, warmup=3, sample_s=0.2)
SMOKE_SETTINGS = Settings("smoke", repeats=2, warmup=1, sample_s=0.005)


def quantized_variants(problem: models.Problem) -> list[variants_lib.Variant]:
  """The ``adamw``, ``adamw_int8`` and ``adamw_int4`` steps (bf16 policy); needs ``jmp.quantize_state``."""
  import optax  # pylint: disable=import-outside-toplevel
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  policy = jmp.get_policy("mixed_bfloat16")
  adamw = optax.adamw(variants_lib.LEARNING_RATE)
  found = []
  coded = {f"adamw_{fmt}": jmp.quantize_state(adamw, format=fmt) for fmt in ("int8", "int4")}
  for name, tx in (("adamw", adamw), *coded.items()):
    init = _fresh_state(jmp.TrainState.create, problem.params, tx)
    found.append(variants_lib.Variant(name, jmp.make_train_step(problem.loss_fn, policy), init))
  return found


def _fresh_state(create: Callable[..., Any], params: Any, tx: Any) -> Callable[[], Any]:
  """``init()``: ``create(params=<a copy of params>, tx=tx)``, a state of its own on each call."""
  return lambda: create(params=variants_lib.copy_tree(params), tx=tx)


def time_variants(found: list[variants_lib.Variant], batch: Any, settings: Settings,
                  on_gpu: bool) -> dict[str, dict[str, Any]]:
  """Compiles, warms up and times ``found`` interleaved; a record per variant (measure.py's)."""
  lives = [measure.prepare(v, batch, settings.warmup) for v in found]
  inner = measure.calibrate(lives, batch, settings.sample_s)
  measure.time_interleaved(lives, batch, settings.repeats, inner)
  records = {}
  for live in lives:
    if on_gpu and live.variant.name in ("f16_dynamic", "f16_noscale"):
      live.record["dispatch"] = measure.dispatch_fraction(live, batch)
    records[live.variant.name] = dict(measure.finish_record(live), inner_steps=inner)
  return records


def pair_ratios(item: Item, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Each of ``item.pairs``: step-time ratios (median, paired median) and the temp-memory ratio."""
  out: dict[str, Any] = {}
  for key, num, den in item.pairs:
    a, b = records[num], records[den]
    c = measure.compare(a["step_s"]["samples"], b["step_s"]["samples"])
    out[key] = c["median"]
    out[key + "_paired_median"] = c["paired_median"]
    ta, tb = a["memory_bytes"]["temp"], b["memory_bytes"]["temp"]
    out[key + "_temp"] = ta / tb if ta is not None and tb else None
  return out


def run_item(item: Item, settings: Settings, on_gpu: bool) -> dict[str, Any]:
  """Measures ``item``: its model and config, records, ratios and bars; or why it was skipped.

  The smoke preset runs every item on the smoke MLP: it checks the plumbing,
  in seconds, not the models.
  """
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  if item.name == "quantized_state" and not hasattr(jmp, "quantize_state"):
    return dict(status="skipped",
                reason="this jmp_lite has no jmp.quantize_state (the int8 optimizer state)")
  if settings.preset == "gpu":
    problem = models.build_problem(item.model, "gpu", **item.sizes)
  else:
    problem = models.build_problem("mlp", settings.preset)
  if item.name == "quantized_state":
    found = quantized_variants(problem)
  else:
    found = [variants_lib.make_variant(n, problem) for n in item.variants]
  records = time_variants(found, problem.batch, settings, on_gpu)
  ratios = pair_ratios(item, records)
  standard = measure.ratios(records, {n: r["step_s"]["samples"] for n, r in records.items()})
  bars = bars_lib.check_bars(problem.name, {**standard, **ratios}, on_gpu,
                             meaningful=settings.preset == "gpu")
  return dict(status="done", model=problem.name, config=problem.config, ratios=ratios, bars=bars,
              variants=records)


def markdown(result: dict[str, Any]) -> str:
  """The report: one row per item, its ratios, then the bars."""
  lines = [report.meta_line(result["meta"]), "",
           f"Budget {result['budget_s']:.0f} s, preset `{result['preset']}`; "
           f"{result['elapsed_s']:.0f} s used. Ratios are step-time medians "
           "(numerator / denominator; below 1 is faster), `_temp` the compiled temp memory.", "",
           "| # | item | status | seconds | results |", "|---|---|---|---|---|"]
  for i, r in enumerate(result["items"], 1):
    if r["status"] == "done":
      cells = ", ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()
                        if v is not None and not k.endswith("_paired_median"))
    else:
      cells = r.get("reason") or r.get("error", "")
    lines.append(f"| {i} | {r['what']} | {r['status']} | {r.get('seconds', 0):.0f} | {cells} |")
  bars = [b for r in result["items"] for b in r.get("bars", [])]
  if bars:
    lines += ["", "| bar | model | value | limit | result |", "|---|---|---|---|---|"]
    lines += [f"| {b['what']} | {b['model']} | {b['value']:.3f} | <= {b['limit']:.3f} | "
              f"{report.bar_status(b)} |" for b in bars]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Items, in order: " + "; ".join(
      f"{i}. {item.name} ({item.what})" for i, item in enumerate(ITEMS, 1)))
  p.add_argument("--budget", type=cli.positive_float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                 help="stop starting items when what is left is less than the next one's "
                      "estimate (default: %(default)s)")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true",
                 help="smoke-sized models and short timings (a CI check on a CPU; "
                      "item estimates scaled down to match)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the items in order within the budget, rewriting ``gpu-run-<device>-<date>.{json,md}`` after each."""
  start = time.perf_counter()
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  settings = SMOKE_SETTINGS if args.smoke else GPU_SETTINGS
  scale = 0.1 if args.smoke else 1.0  # smoke-sized items take a small part of a GPU item's time
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  meta = report.meta(cli.command(PROG, argv), device, args=cli.args_record(args))
  stem = report.output_dir(args.out, args.smoke) / f"gpu-run-{report.machine_name(device)}-{meta['date']}"
  result: dict[str, Any] = dict(meta=meta, budget_s=args.budget, preset=settings.preset,
                                elapsed_s=0.0, items=[])
  overrun = 1.0  # how far the items so far overran their estimates (1 to MAX_OVERRUN)
  for item in ITEMS:
    left = args.budget - (time.perf_counter() - start)
    entry: dict[str, Any] = dict(name=item.name, what=item.what, model=item.model,
                                 estimate_s=item.estimate_s * scale * overrun)
    if left < entry["estimate_s"]:
      entry.update(status="skipped", reason=f"budget: {left:.0f} s left, "
                                            f"estimate {entry['estimate_s']:.0f} s")
    else:
      t0 = time.perf_counter()
      try:
        entry.update(run_item(item, settings, on_gpu))
      except Exception as e:  # noqa: BLE001 - record it, and go on to the next item
        entry.update(status="failed", error=f"{type(e).__name__}: {e}"[:500],
                     traceback=traceback.format_exc()[-4000:])
      entry["seconds"] = time.perf_counter() - t0
      if entry["status"] == "done":
        overrun = min(MAX_OVERRUN, max(overrun, entry["seconds"] / (item.estimate_s * scale)))
    result["items"].append(entry)
    result["elapsed_s"] = time.perf_counter() - start
    report.write(result, stem, markdown(result))
    print(f"[{result['elapsed_s']:6.0f} s] {item.name}: {entry['status']} "
          f"{entry.get('reason') or entry.get('error') or ''}", flush=True)
  print()
  print(markdown(result))
  print(f"wrote {stem}.json and .md")
  return 1 if any(r["status"] == "failed" for r in result["items"]) else 0


if __name__ == "__main__":
  sys.exit(main())
