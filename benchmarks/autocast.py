"""What autocast costs: its compiled step against hand-placed casts, and its trace time.

    python -m benchmarks.autocast                            # about a minute on a 2-core CPU; writes out/
    python -m benchmarks.autocast --out benchmarks/results   # regenerate the committed results
    python -m benchmarks.autocast --smoke                    # seconds, for CI; writes to a temp folder

Two measurements, timed with ``benchmarks.measure``: interleaved repeats (the
order rotates every repeat, so that a busy machine slows both sides alike),
``jax.block_until_ready`` on every result, medians and ratios.

1. **Step time.** A small functional Transformer LM is written once, with cast
   hooks at the places where a careful engineer would put them. With the hooks
   off it is the "natural" model, trained with
   ``make_train_step(loss, mixed_float16, autocast=True)``; with the hooks on
   it is the same model with the casts placed by hand, trained with
   ``autocast=False``. The script first checks that both programs run every
   operation in the same dtype (the multisets of (primitive, output dtypes),
   casts and pure data movement aside, are equal), then compiles both steps
   ahead of time, warms them up and times them. Bar: autocast / hand casts
   <= 1.05.
2. **Trace time.** ``jax.make_jaxpr`` of ``autocast(loss)`` against
   ``jax.make_jaxpr`` of ``loss``, for the functional model and for the Flax
   Transformer of ``benchmarks.models``, forward and under ``jax.grad``. A
   third variant traces ``loss`` to a jaxpr and evaluates it with
   ``jax.core.eval_jaxpr``, changing nothing: the floor for any transform that
   re-evaluates a jaxpr. Bar: autocast / plain <= 2 under ``jax.grad``.

Bars print as PASS or FAIL; a ``--smoke`` run prints them as ``SMOKE (not
meaningful)``. Results go to ``autocast-<machine>-<date>.json`` and ``.md``
under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import jaxpr_as_fun

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import report
from benchmarks import variants as variants_lib

PROG = "python -m benchmarks.autocast"
F32, F16 = jnp.float32, jnp.float16
INIT_SCALE = 2.0**10  # low enough that no step of the random model overflows
STEP_LIMIT = 1.05  # compiled step: autocast / casts placed by hand
TRACE_LIMIT = 2.0  # make_jaxpr under jax.grad: autocast / plain
SMOKE_SIZES = dict(d_model=16, layers=1, heads=2, seq_len=16, batch=4)


class Casts:
  """The cast hooks: identities for the natural model, ``astype`` for the hand-cast one."""

  def __init__(self, hand: bool):
    self.half = (lambda x: x.astype(F16)) if hand else (lambda x: x)
    self.full = (lambda x: x.astype(F32)) if hand else (lambda x: x)


def layer_norm(x, scale, bias, c: Casts):
  x = c.full(x)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * c.full(scale) + c.full(bias)


def attention(x, p, heads: int, c: Casts):
  b, t, d = x.shape
  x = c.half(x)
  q, k, v = ((x @ p[n]).reshape(b, t, heads, d // heads) for n in ("wq", "wk", "wv"))
  # The chain from a matmul to a float32 op (here the softmax's exp) runs in float32.
  scores = c.full(jnp.einsum("bqhd,bkhd->bhqk", q, k)) / math.sqrt(d // heads)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
  shifted = scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True))
  e = jnp.exp(c.full(shifted))
  weights = e / e.sum(-1, keepdims=True)
  out = jnp.einsum("bhqk,bkhd->bqhd", c.half(weights), v).reshape(b, t, d)
  return out @ p["wo"]


def mlp(x, p, c: Casts):
  h = c.half(x) @ p["w1"] + p["b1"]
  return c.half(jax.nn.gelu(c.full(h))) @ p["w2"] + p["b2"]


def loss(params, batch, *, heads: int, c: Casts):
  """Mean next-byte cross-entropy of the functional Transformer."""
  tokens = batch["x"]
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  for p in params["blocks"]:
    x = x + attention(layer_norm(x, p["ln1_s"], p["ln1_b"], c), p, heads, c)
    x = x + mlp(layer_norm(x, p["ln2_s"], p["ln2_b"], c), p, c)
  logits = c.full(c.half(layer_norm(x, params["ln_s"], params["ln_b"], c)) @ params["out"])
  shifted = logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True))
  logp = c.full(shifted) - jnp.log(jnp.exp(c.full(shifted)).sum(-1, keepdims=True))
  return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1).mean()


def init(key: jax.Array, d: int, layers: int, seq_len: int) -> dict[str, Any]:
  """Float32 initial weights of the functional Transformer (256-byte vocabulary)."""
  keys = iter(jax.random.split(key, 6 * layers + 3))
  dense = lambda i, o: jax.random.normal(next(keys), (i, o)) / np.sqrt(i)  # noqa: E731
  block = lambda: {"wq": dense(d, d), "wk": dense(d, d), "wv": dense(d, d), "wo": dense(d, d),  # noqa: E731
                   "w1": dense(d, 4 * d), "b1": jnp.zeros(4 * d), "w2": dense(4 * d, d),
                   "b2": jnp.zeros(d), "ln1_s": jnp.ones(d), "ln1_b": jnp.zeros(d),
                   "ln2_s": jnp.ones(d), "ln2_b": jnp.zeros(d)}
  return {"embed": jax.random.normal(next(keys), (256, d)) * 0.02,
          "pos": jax.random.normal(next(keys), (seq_len, d)) * 0.02,
          "blocks": [block() for _ in range(layers)],
          "ln_s": jnp.ones(d), "ln_b": jnp.zeros(d), "out": dense(d, 256)}


# Casts, calls, and the data movement a cast may sit before or after (a bias
# is broadcast, then cast, or cast, then broadcast: the same arithmetic).
_NOT_COMPUTE = frozenset({"convert_element_type", "jit", "custom_jvp_call", "remat2", "broadcast_in_dim",
                          "reshape", "squeeze", "transpose"})


def dtype_signature(fn: Callable[..., Any], *args: Any) -> collections.Counter:
  """(primitive, output dtypes) of every computing operation of ``fn(*args)``, with multiplicity."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return collections.Counter(
      (e.primitive.name, tuple(str(jaxpr_utils.dtype_of(v)) for v in e.outvars))
      for e in jaxpr_utils.walk(jaxpr) if e.primitive.name not in _NOT_COMPUTE)


def retrace(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """``fn`` traced to a jaxpr and evaluated by ``jax.core.eval_jaxpr``, dtypes unchanged.

  What any jaxpr interpreter pays before it changes anything: the floor for
  autocast's trace time.
  """
  def wrapped(*args):
    flat, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(tree, leaves)))(*flat)
    return jaxpr_as_fun(closed)(*flat)[0]
  return wrapped


def make_batch(args: argparse.Namespace) -> dict[str, np.ndarray]:
  """Random bytes (never zeros): inputs and their next-byte targets."""
  tokens = np.random.default_rng(args.seed).integers(0, 256, (args.batch, args.seq_len + 1))
  return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def step_times(args: argparse.Namespace, batch: dict[str, np.ndarray]) -> dict[str, Any]:
  """Times the autocast step against the hand-cast step (see the module docstring).

  Raises:
    RuntimeError: if the two programs differ in some operation's dtype, or a
      step was skipped while timing (a skipped step does less work).
  """
  policy = jmp.get_policy("mixed_float16")
  params = init(jax.random.key(args.seed), args.d_model, args.layers, args.seq_len)
  natural = lambda p, b: loss(p, b, heads=args.heads, c=Casts(hand=False))  # noqa: E731
  hand = lambda p, b: loss(p, b, heads=args.heads, c=Casts(hand=True))  # noqa: E731
  half_params = policy.cast_to_compute(params)
  if (dtype_signature(jmp.autocast(natural, F16), half_params, batch)
      != dtype_signature(hand, half_params, batch)):
    raise RuntimeError("the hand-cast model does not run every op in autocast's dtype")
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-3), init_scale=INIT_SCALE,
                                growth_interval=variants_lib.GROWTH_INTERVAL)
  new_state = lambda: jmp.TrainState.create(params=variants_lib.copy_tree(params), tx=tx)  # noqa: E731
  scale_of = lambda s: jmp.loss_scale_of(s.opt_state)  # noqa: E731
  variants = [
      variants_lib.Variant("autocast", jmp.make_train_step(natural, policy, autocast=True),
                           new_state, scale_of),
      variants_lib.Variant("hand", jmp.make_train_step(hand, policy), new_state, scale_of),
  ]
  lives = [measure.prepare(v, batch, args.warmup) for v in variants]
  inner = measure.calibrate(lives, batch, args.sample_seconds)
  measure.time_interleaved(lives, batch, args.repeats, inner)
  records = {live.variant.name: measure.finish_record(live) for live in lives}
  skipped = [n for n, r in records.items() if r["skipped_during_timing"]]
  if skipped:
    raise RuntimeError(f"steps were skipped while timing {skipped}: that would flatter them")
  return dict(
      same_dtypes=True,
      inner_steps_per_sample=inner,
      variants=records,
      ratio=measure.compare(records["autocast"]["step_s"]["samples"],
                            records["hand"]["step_s"]["samples"]),
  )


def trace_problems(args: argparse.Namespace, batch: dict[str, np.ndarray]) -> list[tuple]:
  """``(model, loss_fn, f16 params, batch)`` for the functional and the Flax Transformer."""
  policy = jmp.get_policy("mixed_float16")
  functional = lambda p, b: loss(p, b, heads=args.heads, c=Casts(hand=False))  # noqa: E731
  params = policy.cast_to_compute(init(jax.random.key(args.seed), args.d_model, args.layers,
                                       args.seq_len))
  flax = models.build_problem("transformer", "smoke" if args.smoke else "cpu", batch=args.batch,
                              layers=args.layers, hidden=args.d_model, seed=args.seed)
  return [("functional", functional, params, batch),
          ("flax", flax.loss_fn, policy.cast_to_compute(flax.params), flax.batch)]


def trace_times(args: argparse.Namespace, batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """Median ``make_jaxpr`` times: plain, trace + eval_jaxpr, and autocast; forward and grad."""
  rows = []
  for model, fn, p, b in trace_problems(args, batch):
    for kind, wrap in (("forward", lambda f: f), ("grad", jax.grad)):
      # A fresh function per trace: make_jaxpr caches on the function object.
      calls = {
          "plain": lambda: jax.make_jaxpr(lambda *a: wrap(fn)(*a))(p, b),
          "eval_jaxpr": lambda: jax.make_jaxpr(lambda *a: wrap(retrace(fn))(*a))(p, b),
          "autocast": lambda: jax.make_jaxpr(lambda *a: wrap(jmp.autocast(fn, F16))(*a))(p, b),
      }
      measure.time_calls(calls, args.warmup)
      times = measure.time_calls(calls, args.trace_repeats)
      med = {k: statistics.median(v) for k, v in times.items()}
      rows.append(dict(
          model=model, trace=kind, plain_s=med["plain"], eval_jaxpr_s=med["eval_jaxpr"],
          autocast_s=med["autocast"],
          ratio=measure.compare(times["autocast"], times["plain"]),
          ratio_to_eval_jaxpr=measure.compare(times["autocast"], times["eval_jaxpr"]),
      ))
  return rows


def check_bars(step: dict[str, Any], traces: list[dict[str, Any]], meaningful: bool) -> list:
  """The step bar (autocast / hand <= 1.05) and one trace bar per model under grad (<= 2)."""
  bars = [bars_lib.bar("step", "compiled step: autocast / casts placed by hand",
                       step["ratio"]["median"], STEP_LIMIT, meaningful, model="functional")]
  for r in traces:
    if r["trace"] == "grad":
      bars.append(bars_lib.bar("trace_grad", "make_jaxpr under jax.grad: autocast / plain",
                               r["ratio"]["median"], TRACE_LIMIT, meaningful, model=r["model"]))
  return bars


def markdown(result: dict[str, Any]) -> str:
  """The Markdown report: the step table, the trace table and the bars."""
  step, cfg = result["step"], result["config"]
  v = step["variants"]
  ms = lambda rec: f"{rec['step_s']['median'] * 1e3:.2f}"  # noqa: E731
  lines = [
      report.meta_line(result["meta"]), "",
      f"Functional Transformer {cfg['layers']}x d_model {cfg['d_model']}, {cfg['heads']} heads, "
      f"batch {cfg['batch']} x {cfg['seq_len']}; {cfg['repeats']} interleaved repeats x "
      f"{step['inner_steps_per_sample']} steps.", "",
      "| variant | step ms (median) |", "|---|---|",
      f"| autocast (natural model, autocast=True) | {ms(v['autocast'])} |",
      f"| casts placed by hand (same dtypes) | {ms(v['hand'])} |",
      f"| ratio (median / paired median) | {step['ratio']['median']:.3f} / "
      f"{step['ratio']['paired_median']:.3f} |", "",
      "| model | trace | plain ms | trace + eval_jaxpr ms | autocast ms | autocast / plain | "
      "autocast / eval_jaxpr |", "|---|---|---|---|---|---|---|",
  ]
  for r in result["trace"]:
    lines.append(
        f"| {r['model']} | {r['trace']} | {r['plain_s'] * 1e3:.1f} | "
        f"{r['eval_jaxpr_s'] * 1e3:.1f} | {r['autocast_s'] * 1e3:.1f} | "
        f"{r['ratio']['median']:.2f} | {r['ratio_to_eval_jaxpr']['median']:.2f} |")
  lines += ["", *report.bars_table(result["bars"])]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Bars: compiled step <= 1.05x hand casts; trace <= 2x under grad.")
  smoke = lambda k: f"; --smoke: {SMOKE_SIZES[k]}"  # noqa: E731
  p.add_argument("--d-model", type=cli.positive_int, default=128,
                 help=f"model width (default: %(default)s{smoke('d_model')})")
  p.add_argument("--layers", type=cli.positive_int, default=2,
                 help=f"Transformer blocks (default: %(default)s{smoke('layers')})")
  p.add_argument("--heads", type=cli.positive_int, default=4,
                 help=f"attention heads; must divide --d-model (default: %(default)s"
                      f"{smoke('heads')})")
  p.add_argument("--seq-len", type=cli.positive_int, default=64,
                 help=f"bytes per sequence (default: %(default)s{smoke('seq_len')})")
  p.add_argument("--batch", type=cli.positive_int, default=16,
                 help=f"sequences per step (default: %(default)s{smoke('batch')})")
  cli.add_timing_arguments(p, "--repeats", 41, "; with --smoke 3")
  p.add_argument("--trace-repeats", type=cli.positive_int, default=11,
                 help="interleaved repeats of each trace (default: %(default)s; with --smoke 2)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the weights and the batch (default: %(default)s)")
  cli.add_common_arguments(p, "a tiny model, 3 repeats, bars not meaningful: a CI check",
                           variants=False)
  p.add_argument("--strict", action="store_true",
                 help="exit with status 1 if a meaningful bar fails")
  return p


def parse_args(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
  """Parses and checks ``argv``; ``--smoke`` shrinks the model and the repeats."""
  args = p.parse_args(argv)
  if args.smoke:
    for k, v in SMOKE_SIZES.items():
      setattr(args, k, v)
    args.repeats, args.warmup, args.trace_repeats = min(args.repeats, 3), 1, 2
    args.sample_seconds = 1e-9
  if args.d_model % args.heads:
    p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
  return args


def main(argv: list[str] | None = None) -> int:
  """Runs both measurements; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser()
  args = parse_args(p, argv)
  cli.select_platform(args)
  device = cli.device(args, p)
  out = report.output_dir(args.out, args.smoke)
  print(f"functional Transformer {args.layers}x d_model {args.d_model}, {args.heads} heads, "
        f"batch {args.batch} x {args.seq_len} bytes, mixed_float16; {args.repeats} step repeats, "
        f"{args.trace_repeats} trace repeats on {device.device_kind}; results will be written to "
        f"{out}", flush=True)
  batch = make_batch(args)
  print("timing the compiled steps (autocast vs casts placed by hand) ...", flush=True)
  step = step_times(args, batch)
  print("timing the traces (make_jaxpr of autocast(loss) vs of loss) ...", flush=True)
  traces = trace_times(args, batch)
  bars = check_bars(step, traces, meaningful=not args.smoke)
  result = dict(
      meta=report.meta(cli.command(PROG, argv), device, smoke=args.smoke,
                       init_scale=INIT_SCALE),
      config=cli.args_record(args),
      step=step,
      trace=traces,
      bars=bars,
      all_bars_pass=None if args.smoke else all(b["passed"] for b in bars),
  )
  text = markdown(result)
  stem = out / f"autocast-{report.machine_name(device)}-{result['meta']['date']}"
  report.write(result, stem, text)
  print()
  print(text)
  for b in bars:
    print(report.bar_line(b))
  print(f"wrote {stem}.json and .md")
  return 1 if args.strict and result["all_bars_pass"] is False else 0


if __name__ == "__main__":
  sys.exit(main())
