"""What autocast costs: its compiled step against hand-placed casts, its trace time.

    python examples/autocast_overhead.py            # about a minute on a 2-core CPU
    python examples/autocast_overhead.py --smoke    # seconds

Two measurements, each as a median over interleaved repeats (A B A B ...), so
that a busy machine slows both variants alike:

1. **Step time.** A small functional Transformer LM is written once, with cast
   hooks at the places where a careful engineer would put them. With the hooks
   off it is the "natural" model, trained with
   ``make_train_step(loss, mixed_float16, autocast=True)``; with the hooks on
   it is the same model with the casts placed by hand, trained with
   ``autocast=False``. The script first checks that both programs run every
   operation in the same dtype (the multisets of (primitive, output dtypes),
   casts and pure data movement aside, are equal), then times the compiled
   steps.
2. **Trace time.** ``jax.make_jaxpr`` of ``autocast(loss)`` against
   ``jax.make_jaxpr`` of ``loss``, for the functional model and for the Flax
   model of ``transformer_lm.py``, forward and ``jax.grad``. A third variant
   traces ``loss`` to a jaxpr and evaluates it with ``jax.core.eval_jaxpr``,
   changing nothing: the floor for any transform that re-evaluates a jaxpr.

Results are printed and written to ``--out`` (default ``out/autocast_overhead``)
as ``autocast_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import jaxpr_as_fun

import jmp_lite as jmp
from jmp_lite._src import jaxpr_utils

import _common
import transformer_lm

NAME = "autocast_overhead"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "out" / NAME
F32, F16 = jnp.float32, jnp.float16


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
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
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
  tokens = batch["x"]
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  for p in params["blocks"]:
    x = x + attention(layer_norm(x, p["ln1_s"], p["ln1_b"], c), p, heads, c)
    x = x + mlp(layer_norm(x, p["ln2_s"], p["ln2_b"], c), p, c)
  logits = c.half(layer_norm(x, params["ln_s"], params["ln_b"], c)) @ params["out"]
  shifted = logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True))
  logp = c.full(shifted) - jnp.log(jnp.exp(c.full(shifted)).sum(-1, keepdims=True))
  return -jnp.take_along_axis(logp, batch["y"][..., None], axis=-1).mean()


def init(key: jax.Array, d: int, layers: int, seq_len: int) -> dict[str, Any]:
  keys = iter(jax.random.split(key, 6 * layers + 3))
  dense = lambda i, o: jax.random.normal(next(keys), (i, o)) / np.sqrt(i)
  block = lambda: {"wq": dense(d, d), "wk": dense(d, d), "wv": dense(d, d), "wo": dense(d, d),
                   "w1": dense(d, 4 * d), "b1": jnp.zeros(4 * d), "w2": dense(4 * d, d),
                   "b2": jnp.zeros(d), "ln1_s": jnp.ones(d), "ln1_b": jnp.zeros(d),
                   "ln2_s": jnp.ones(d), "ln2_b": jnp.zeros(d)}
  return {"embed": jax.random.normal(next(keys), (256, d)) * 0.02,
          "pos": jax.random.normal(next(keys), (seq_len, d)) * 0.02,
          "blocks": [block() for _ in range(layers)],
          "ln_s": jnp.ones(d), "ln_b": jnp.zeros(d), "out": dense(d, 256)}


# Casts, calls, and the data movement a cast may sit before or after (a bias
# is broadcast, then cast, or cast, then broadcast: the same arithmetic).
_NOT_COMPUTE = frozenset({"convert_element_type", "jit", "custom_jvp_call", "broadcast_in_dim",
                          "reshape", "squeeze", "transpose"})


def dtype_signature(fn: Callable[..., Any], *args: Any) -> collections.Counter:
  """(primitive, output dtypes) of every computing operation, with multiplicity."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return collections.Counter(
      (e.primitive.name, tuple(str(jaxpr_utils.dtype_of(v)) for v in e.outvars))
      for e in jaxpr_utils.walk(jaxpr) if e.primitive.name not in _NOT_COMPUTE)


def interleaved(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
  """Seconds per call of each variant, measured A B A B ... (order rotated each repeat)."""
  times: dict[str, list[float]] = {k: [] for k in variants}
  names = list(variants)
  for i in range(repeats):
    for name in names[i % len(names):] + names[: i % len(names)]:
      start = time.perf_counter()
      jax.block_until_ready(variants[name]())
      times[name].append(time.perf_counter() - start)
  return times


def step_times(args: argparse.Namespace, batch: dict[str, np.ndarray]) -> dict[str, Any]:
  policy = jmp.get_policy("mixed_float16")
  params = init(jax.random.key(args.seed), args.d_model, args.layers, args.seq_len)
  natural = lambda p, b: loss(p, b, heads=args.heads, c=Casts(hand=False))
  hand = lambda p, b: loss(p, b, heads=args.heads, c=Casts(hand=True))
  half_params = policy.cast_to_compute(params)
  same = (dtype_signature(jmp.autocast(natural, F16), half_params, batch)
          == dtype_signature(hand, half_params, batch))
  if not same:
    raise AssertionError("the hand-cast model does not run every op in autocast's dtype")
  tx = jmp.dynamic_loss_scaling(optax.adam(1e-3), init_scale=2.0**10)
  states = {k: jmp.TrainState.create(params=params, tx=tx) for k in ("autocast", "hand")}
  steps = {"autocast": jmp.make_train_step(natural, policy, autocast=True),
           "hand": jmp.make_train_step(hand, policy)}
  finite = {k: [] for k in steps}

  def call(name):
    def run():
      states[name], metrics = steps[name](states[name], batch)
      finite[name].append(metrics["grads_finite"])
      return metrics["loss"]
    return run

  variants = {k: call(k) for k in steps}
  interleaved(variants, args.warmup)  # compiles, then warms up
  times = interleaved(variants, args.repeats)
  skipped = {k: int(sum(not bool(f) for f in v)) for k, v in finite.items()}
  if any(skipped.values()):
    raise AssertionError(f"skipped steps would flatter a variant: {skipped}")
  med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  return {"same_dtypes": same, "autocast_ms": med["autocast"], "hand_ms": med["hand"],
          "ratio": med["autocast"] / med["hand"],
          "paired_ratio": statistics.median(
              a / h for a, h in zip(times["autocast"], times["hand"]))}


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


def trace_times(args: argparse.Namespace, batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  policy = jmp.get_policy("mixed_float16")
  functional = lambda p, b: loss(p, b, heads=args.heads, c=Casts(hand=False))
  params = policy.cast_to_compute(init(jax.random.key(args.seed), args.d_model, args.layers,
                                       args.seq_len))
  flax_model = transformer_lm.TransformerLM(d_model=args.d_model, layers=args.layers,
                                            heads=args.heads, max_len=args.seq_len)
  flax_params = policy.cast_to_compute(
      jax.jit(flax_model.init)(jax.random.key(args.seed), batch["x"]))
  flax_loss = lambda p, b: transformer_lm.loss_fn(flax_model, p, b)
  rows = []
  for model, fn, p in (("functional", functional, params), ("flax", flax_loss, flax_params)):
    for kind, wrap in (("forward", lambda f: f), ("grad", jax.grad)):
      # A fresh function per trace: make_jaxpr caches on the function object.
      variants = {
          "plain": lambda: jax.make_jaxpr(lambda *a: wrap(fn)(*a))(p, batch),
          "eval_jaxpr": lambda: jax.make_jaxpr(lambda *a: wrap(retrace(fn))(*a))(p, batch),
          "autocast": lambda: jax.make_jaxpr(lambda *a: wrap(jmp.autocast(fn, F16))(*a))(p, batch),
      }
      interleaved(variants, 2)
      times = interleaved(variants, args.trace_repeats)
      med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
      rows.append({"model": model, "trace": kind, "plain_ms": med["plain"],
                   "eval_jaxpr_ms": med["eval_jaxpr"], "autocast_ms": med["autocast"],
                   "ratio": med["autocast"] / med["plain"],
                   "ratio_to_eval_jaxpr": med["autocast"] / med["eval_jaxpr"]})
  return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeats", type=int, default=41, help="interleaved step-time repeats")
  p.add_argument("--trace-repeats", type=int, default=11, help="interleaved trace-time repeats")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--out", type=Path, default=DEFAULT_OUT)
  args = p.parse_args(argv)
  if args.smoke:
    args.d_model, args.layers, args.seq_len, args.batch = 16, 1, 16, 4
    args.warmup, args.repeats, args.trace_repeats = 1, 3, 2
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  print(f"Transformer {args.layers}x d_model {args.d_model}, batch {args.batch} x {args.seq_len}; "
        f"{_common.machine()}", flush=True)
  rng = np.random.default_rng(args.seed)
  tokens = rng.integers(0, 256, (args.batch, args.seq_len + 1))
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  print("timing the compiled steps (autocast vs casts placed by hand) ...", flush=True)
  steps = step_times(args, batch)
  print("timing the traces (make_jaxpr of autocast(loss) vs of loss) ...", flush=True)
  traces = trace_times(args, batch)
  step_table = _common.markdown_table(
      ["variant", "step ms (median)"],
      [["autocast (natural model, autocast=True)", f"{steps['autocast_ms']:.2f}"],
       ["casts placed by hand (same dtypes)", f"{steps['hand_ms']:.2f}"],
       ["ratio (median / paired median)", f"{steps['ratio']:.3f} / {steps['paired_ratio']:.3f}"]])
  trace_table = _common.markdown_table(
      ["model", "trace", "plain ms", "trace + eval_jaxpr ms", "autocast ms", "autocast / plain",
       "autocast / eval_jaxpr"],
      [[r["model"], r["trace"], f"{r['plain_ms']:.1f}", f"{r['eval_jaxpr_ms']:.1f}",
        f"{r['autocast_ms']:.1f}", f"{r['ratio']:.2f}", f"{r['ratio_to_eval_jaxpr']:.2f}"]
       for r in traces])
  text = f"{step_table}\n\n{trace_table}"
  print()
  print(text)
  payload = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
             "step": steps, "trace": traces}
  written = _common.write_results(args.out, NAME, text, payload)
  print("wrote " + ", ".join(str(p) for p in written))
  return payload


if __name__ == "__main__":
  main()
