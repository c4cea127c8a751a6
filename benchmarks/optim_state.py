"""The optimizer state's memory: bytes per parameter, the H100 update's temp, the CPU update time.

Run ``python -m benchmarks.optim_state --help``. For each benchmark model
(``benchmarks/models.py``, at the ``--preset`` sizes) and one Transformer of
134M parameters (built as shapes only, never allocated), it compares four
optimizers:

- ``adamw``: ``optax.adamw`` with float32 state, float32 masters;
- ``int8``, ``float8`` and ``int4``: ``jmp.quantize_state(optax.adamw, format)``, with
  bfloat16 masters and stochastic rounding;
- ``int4_all``: ``int4`` with ``min_size=0``, so that the leaves under
  4,096 elements (biases, norms), which the default keeps in float32 as
  torchao does, are coded too.

and reports:

- **persistent** bytes per parameter: ``jmp.memory_ledger`` of the
  ``TrainState`` each builds (``jax.eval_shape``, nothing allocated);
- the **update's temp**: the optimizer update (``tx.update`` and
  ``optax.apply_updates``, params and state donated, float32 params for all
  three so that only the optimizer differs) compiled for an H100 that this
  machine does not have (deviceless, as ``benchmarks.gpu_compile`` does), and
  its ``memory_analysis()`` temp bytes;
- **peak** bytes per parameter: persistent + float32 gradients (4 bytes) +
  the update's temp, what the update phase of a step holds at once
  (activations, which the forward and backward hold and release earlier, are
  not counted);
- the **CPU update time**: the jitted update on this machine's CPU,
  interleaved with ``adamw``'s, median ratio (the 134M model is compiled only).

Bars: the update's temp for every coded variant at most ``adamw``'s, on
every model; with bf16 masters, int8 at most 4.1 and int4 and int4_all at
most 3.1 bytes per parameter persistent (on the small benchmark models the
float32 moments of the leaves under ``min_size`` alone can put the default
int4 over it: the CNN's 2,186 such elements of 75,914).
Without the CUDA plugin the H100 columns are left out.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
from typing import Any, Callable

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import gpu_compile  # Sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK before JAX starts.
from benchmarks import models
from benchmarks import report

PROG = "python -m benchmarks.optim_state"
VARIANTS = ("adamw", "int8", "float8", "int4", "int4_all")
CODED = VARIANTS[1:]
BIG = "transformer_134m"
BIG_CONFIG = dict(vocab=32000, seq_len=512, d_model=768, num_heads=12, mlp_dim=3072, num_layers=12)
SMOKE_BIG = dict(vocab=512, seq_len=16, d_model=64, num_heads=2, mlp_dim=128, num_layers=1)
PERSISTENT_LIMIT = 4.1
INT4_PERSISTENT_LIMIT = 3.1
SMOKE_MODELS = ("mlp", BIG)


def make_tx(variant: str) -> Any:
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  tx = optax.adamw(1e-3)
  if variant == "int4_all":  # every leaf coded: the small ones (biases, norms) too
    return jmp.quantize_state(tx, "int4", min_size=0)
  return tx if variant == "adamw" else jmp.quantize_state(tx, variant)


def big_params(config: dict[str, int]) -> Any:
  """The Transformer's params as ``ShapeDtypeStruct``s (``jax.eval_shape`` of its init)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  module = models.Transformer(**config)
  tokens = jax.ShapeDtypeStruct((1, config["seq_len"]), jnp.int32)
  return jax.eval_shape(module.init, jax.random.key(0), tokens)["params"]


def persistent(variant: str, params: Any) -> dict[str, Any]:
  """``memory_ledger`` of the variant's ``TrainState``, from shapes only."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  def build() -> Any:
    concrete = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    if variant == "adamw":
      return jmp.TrainState.create(params=concrete, tx=make_tx(variant))
    return jmp.TrainState.create(params=concrete, tx=make_tx(variant), master_dtype=jnp.bfloat16,
                                 rounding="stochastic", key=jax.random.key(0))

  ledger = jmp.memory_ledger(jax.eval_shape(build))
  return dict(params=ledger.params, persistent_bytes=ledger.total_bytes,
              persistent_per_param=ledger.bytes_per_param,
              state_bytes=ledger.bytes_of("optimizer state"))


def update_fn(variant: str) -> Callable[..., Any]:
  """``(grads, opt_state, params) -> (params, opt_state)``, jitted, state and params donated."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  tx = make_tx(variant)

  def update(grads: Any, opt_state: Any, params: Any) -> Any:
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(update, donate_argnums=(1, 2))


def update_args(variant: str, params: Any) -> tuple[Any, Any, Any]:
  """Shapes of ``(grads, opt_state, params)`` for :func:`update_fn`, float32 params."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  f32 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), params)
  state = jax.eval_shape(make_tx(variant).init, f32)
  return f32, state, f32


def h100_update(variant: str, params: Any, target: str = "h100") -> dict[str, int]:
  """The update compiled for an H100 (``jmp.compile_for_gpu``): its temp, argument, output and alias bytes."""
  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  r = jmp.compile_for_gpu(update_fn(variant), *update_args(variant, params), target=target)
  return dict(temp_bytes=r.temp_bytes, argument_bytes=r.argument_bytes,
              output_bytes=r.output_bytes, alias_bytes=r.alias_bytes)


def materialize(shapes: Any, seed: int) -> Any:
  """Random normal arrays of ``shapes`` (never zeros)."""
  import jax  # pylint: disable=import-outside-toplevel

  leaves, tree = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, s.dtype)
                                   for k, s in zip(keys, leaves)])


def cpu_times(params: Any, repeats: int) -> dict[str, float]:
  """Median seconds of each variant's jitted update on the CPU, the variants interleaved."""
  import time  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  grads, p = materialize(params, 1), materialize(params, 2)
  live = {}
  for variant in VARIANTS:
    fn = jax.jit(update_fn(variant).__wrapped__)  # no donation: the same buffers every call
    state = make_tx(variant).init(p)
    jax.block_until_ready(fn(grads, state, p))  # compile and warm up
    live[variant] = (fn, state)
  times: dict[str, list[float]] = {v: [] for v in VARIANTS}
  for r in range(repeats):
    k = r % len(VARIANTS)
    for variant in VARIANTS[k:] + VARIANTS[:k]:
      fn, state = live[variant]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(grads, state, p))
      times[variant].append(time.perf_counter() - t0)
  return {v: statistics.median(t) for v, t in times.items()}


def model_params(name: str, preset: str) -> Any:
  """The params of a benchmark model (float32, as ``ShapeDtypeStruct``s) or of the big Transformer."""
  import jax  # pylint: disable=import-outside-toplevel

  if name == BIG:
    return big_params(SMOKE_BIG if preset == "smoke" else BIG_CONFIG)
  problem = models.build_problem(name, preset)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), problem.params)


def measure_model(name: str, preset: str, target: str | None, repeats: int) -> list[dict[str, Any]]:
  """One row per variant: persistent, H100 update temp and peak, CPU update time."""
  params = model_params(name, preset)
  times = cpu_times(params, repeats) if name != BIG and repeats else {}
  rows = []
  for variant in VARIANTS:
    row: dict[str, Any] = dict(model=name, variant=variant, **persistent(variant, params))
    if target is not None:
      row.update(h100_update(variant, params, target))
      row["peak_per_param"] = (row["persistent_bytes"] + 4 * row["params"]
                               + row["temp_bytes"]) / row["params"]
    if times:
      row["cpu_update_s"] = times[variant]
      row["cpu_vs_adamw"] = times[variant] / times["adamw"]
    rows.append(row)
    print(f"{name:17s} {variant:7s} persistent {row['persistent_per_param']:6.3f} B/param"
          + (f"  H100 update temp {row['temp_bytes'] / 2**20:9.2f} MiB" if "temp_bytes" in row else "")
          + (f"  CPU update {row['cpu_vs_adamw']:.2f}x adamw" if times else ""), flush=True)
  return rows


def check_bars(rows: list[dict[str, Any]], meaningful: bool) -> list[dict[str, Any]]:
  """Update temp of each coded variant <= adamw's (per model); persistent <= 4.1 (int8), 3.1 (int4, int4_all)."""
  index = {(r["model"], r["variant"]): r for r in rows}
  found = []
  for model in dict.fromkeys(r["model"] for r in rows):
    base = index[model, "adamw"]
    for variant in CODED:
      row = index.get((model, variant), {})
      if "temp_bytes" in row:
        found.append(bars_lib.bar("optim_state", f"{variant} / adamw H100 update temp",
                                  row["temp_bytes"] / max(base["temp_bytes"], 1), 1.0, meaningful,
                                  model=model))
    found.append(bars_lib.bar("optim_state", "int8 + bf16 masters: persistent bytes/param",
                              index[model, "int8"]["persistent_per_param"], PERSISTENT_LIMIT,
                              meaningful, model=model))
    for variant in ("int4", "int4_all"):
      if (model, variant) in index:
        found.append(bars_lib.bar("optim_state", f"{variant} + bf16 masters: persistent bytes/param",
                                  index[model, variant]["persistent_per_param"],
                                  INT4_PERSISTENT_LIMIT, meaningful, model=model))
  return found


def markdown(result: dict[str, Any]) -> str:
  """The report: one table of every model and variant, then the bars."""
  lines = [report.meta_line(result["meta"]), "",
           "Persistent: `jmp.memory_ledger` of the TrainState (adamw: float32 masters; int8, "
           "float8, int4, int4_all: bf16 stochastic masters; int4_all: min_size=0, every leaf coded). H100: the update (`tx.update` + `apply_updates`, "
           "float32 params, state donated) compiled for an H100, not run. Peak: persistent + "
           "float32 grads + the update's temp. CPU: the jitted update on this machine, median, "
           "interleaved.", "",
           "| model | params | variant | persistent B/param | H100 update temp MiB | "
           "peak B/param | CPU update ms | CPU vs adamw |",
           "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    temp = f"{r['temp_bytes'] / 2**20:.2f}" if "temp_bytes" in r else "-"
    peak = f"{r['peak_per_param']:.3f}" if "peak_per_param" in r else "-"
    cpu = f"{r['cpu_update_s'] * 1e3:.2f}" if "cpu_update_s" in r else "-"
    ratio = f"{r['cpu_vs_adamw']:.2f}x" if "cpu_vs_adamw" in r else "-"
    lines.append(f"| {r['model']} | {r['params']:,} | {r['variant']} | "
                 f"{r['persistent_per_param']:.3f} | {temp} | {peak} | {cpu} | {ratio} |")
  lines += ["", *report.bars_table(result["bars"])]
  return "\n".join(lines) + "\n"


def build_parser() -> Any:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Variants: " + ", ".join(VARIANTS) + f". Models: "
                 + ", ".join((*models.DEFAULT_MODELS, BIG)))
  p.add_argument("--model", default="all", metavar="LIST",
                 help=f"comma-separated models of {', '.join((*models.MODELS, BIG))}, or all "
                      f"({', '.join((*models.DEFAULT_MODELS, BIG))}; default: %(default)s)")
  p.add_argument("--preset", default="cpu", choices=("cpu", "gpu"),
                 help="benchmark model sizes (default: %(default)s)")
  p.add_argument("--repeats", type=cli.positive_int, default=20,
                 help="timed CPU updates per variant (default: %(default)s)")
  p.add_argument("--no-gpu-compile", action="store_true",
                 help="leave out the H100 compile (it needs the CUDA plugin)")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true",
                 help=f"smoke-sized {' and '.join(SMOKE_MODELS)}, 2 timed repeats: a CI check")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  return p


def main(argv: list[str] | None = None) -> int:
  """Measures and writes ``optim-state-<machine>-<date>.{json,md}``."""
  argv = sys.argv[1:] if argv is None else argv
  p = build_parser()
  args = p.parse_args(argv)
  all_models = (*models.DEFAULT_MODELS, BIG)
  names = cli.choose(args.model, (*models.MODELS, BIG), SMOKE_MODELS if args.smoke else all_models,
                     "model")
  target = None if args.no_gpu_compile or gpu_compile.plugin_missing() is not None else "h100"
  if target is not None:  # The GPU topology starts before the CPU is made JAX's only platform.
    gpu_compile.gpu_lib.topology_sharding(target)
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", "cpu")
  preset = "smoke" if args.smoke else args.preset
  rows = []
  for name in names:
    rows += measure_model(name, preset, target, 2 if args.smoke else args.repeats)
  bars = check_bars(rows, meaningful=not args.smoke)
  meta = report.meta(cli.command(PROG, argv), jax.devices("cpu")[0], args=cli.args_record(args),
                     smoke=args.smoke, compiled_for=target)
  result = dict(meta=meta, rows=rows, bars=bars)
  machine = report.machine_name(jax.devices("cpu")[0])
  stem = report.output_dir(args.out, args.smoke) / f"optim-state-{machine}-{meta['date']}"
  report.publish(result, stem, markdown(result))
  return report.bars_status(bars, args.strict)


if __name__ == "__main__":
  sys.exit(main())
