"""The per-call cost of the train step on small models, against the plain ``jax.jit`` steps it replaces.

    python -m benchmarks.call_overhead                            # about 2 minutes on a 2-core CPU; writes out/
    python -m benchmarks.call_overhead --out benchmarks/results   # regenerate the committed results
    python -m benchmarks.call_overhead --smoke                    # seconds, for CI; writes to a temp folder

On a small model a step's time is mostly the cost of calling it: the Python
side of the call, jax's dispatch, one buffer per output. Every variant trains
the same model on the same batch with the same optimizer, donates its state,
and is warmed up before timing. Each sample times ``inner`` consecutive calls
followed by ``block_until_ready``; the variants of a model are sampled
interleaved (their order rotates each repeat); times are medians. Next to
the wall time per call, the report gives the calling thread's CPU time per
call (``time.thread_time``), which other processes on a shared machine
disturb less.

Models and variants:

  tiny     an 8x8 matmul and a mean squared error (issue 31's model), float32:
             jax_jit          jax.jit(step, donate_argnums=0) over (params, opt_state), sgd
             jmp_lite         make_train_step(loss_fn, "f32"), the same sgd
             jmp_same_jit     the same jitted program as jmp_lite, called through jax.jit
                              directly: what the program itself costs
             jax_jit_dls      as jax_jit, with dynamic_loss_scaling(sgd) and the loss scaled
             jmp_lite_dls     as jmp_lite, with dynamic_loss_scaling(sgd)
  bilstm   an SST-2-sized Linen BiLSTM classifier (Embed, a bidirectional
           OptimizedLSTMCell RNN, Dense), adam, float32:
             flax             flax.training.train_state.TrainState + jax.jit, donated
             jmp_lite         make_train_step(loss_fn, "f32")
  vit      a small Linen ViT (patch Conv, MultiHeadDotProductAttention,
           LayerNorm, an MLP), adam, float32: flax and jmp_lite as for bilstm.

The bars (``tiny``): jmp_lite / jax_jit and jmp_lite_dls / jax_jit_dls (issue
31's target: at most 1.15), and jmp_lite / jmp_same_jit, the Python side of
the call alone (at most 1.10: a few microseconds). The bilstm and vit ratios (jmp_lite / flax,
the new user's comparison) are reported, with the largest relative difference
of their losses over the timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import measure
from benchmarks import models
from benchmarks import report
import jmp_lite as jmp

PROG = "python -m benchmarks.call_overhead"
MODELS = ("tiny", "bilstm", "vit")
# (bar, numerator, denominator, limit, model)
BARS = (
    ("vs_jax_jit", "jmp_lite", "jax_jit", 1.15, "tiny"),
    ("vs_jax_jit_dls", "jmp_lite_dls", "jax_jit_dls", 1.15, "tiny"),
    ("python_side", "jmp_lite", "jmp_same_jit", 1.10, "tiny"),
)
REPORTED = (("vs_flax", "jmp_lite", "flax", "bilstm"), ("vs_flax", "jmp_lite", "flax", "vit"))

# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


class BiLSTM(nn.Module):
  """Embedding, a bidirectional LSTM over the sequence, mean pooling, a linear head."""

  vocab: int
  hidden: int

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.hidden)(tokens)
    x = nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(self.hidden)),
                         nn.RNN(nn.OptimizedLSTMCell(self.hidden)))(x)
    return nn.Dense(2)(jnp.mean(x, axis=1))


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def build(model: str, smoke: bool) -> tuple[Callable[..., Any], Any, Any]:
  """``(loss_fn(params, batch), params, batch)`` for ``model``, with fixed seeds."""
  rng = np.random.default_rng(0)
  if model == "tiny":
    params = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
    batch = {"x": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
             "y": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}
    return (lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)), params, batch
  if model == "bilstm":
    net: nn.Module = BiLSTM(vocab=500, hidden=16 if smoke else 32)
    inputs = jnp.asarray(rng.integers(0, 500, (8 if smoke else 32, 8 if smoke else 24)), jnp.int32)
    classes = 2
  else:
    net = models.ViT(patch=4, hidden=16 if smoke else 32, heads=2, layers=1 if smoke else 2,
                     classes=10, mlp_ratio=2)
    inputs = jnp.asarray(rng.standard_normal((8 if smoke else 32, 16, 16, 3)), jnp.float32)
    classes = 10
  batch = {"x": inputs, "y": jnp.asarray(rng.integers(0, classes, inputs.shape[0]), jnp.int32)}
  params = net.init(jax.random.key(0), inputs)["params"]
  return (lambda p, b: _xent(net.apply({"params": p}, b["x"]), b["y"])), params, batch


# --------------------------------------------------------------------------- #
# Variants: (call(state, batch) -> (state, loss), initial state)
# --------------------------------------------------------------------------- #

Variant = tuple[Callable[[Any, Any], tuple[Any, jax.Array]], Any]


def _jax_jit(loss_fn: Callable[..., Any], params: Any, tx: optax.GradientTransformation) -> Variant:
  """A plain jitted step over ``(params, opt_state)``; the loss scaled by ``tx``'s scale, if any."""

  def step(carry: Any, batch: Any) -> tuple[Any, jax.Array]:
    p, s = carry
    scale = jmp.loss_scale_of(s)
    loss, grads = jax.value_and_grad(lambda q: loss_fn(q, batch) * scale)(p)
    updates, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), loss / scale

  return jax.jit(step, donate_argnums=0), (jax.tree.map(jnp.copy, params), tx.init(params))


def _flax(loss_fn: Callable[..., Any], params: Any, tx: optax.GradientTransformation) -> Variant:
  """A Flax ``TrainState`` step, as the new user's scripts had it."""

  def step(state: Any, batch: Any) -> tuple[Any, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  state = train_state.TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, params), tx=tx)
  return jax.jit(step, donate_argnums=0), state


def _jmp_lite(loss_fn: Callable[..., Any], params: Any, tx: optax.GradientTransformation,
              same_jit: bool = False) -> Variant:
  """``make_train_step``; with ``same_jit``, its jitted program called directly."""
  step = jmp.make_train_step(loss_fn, jmp.get_policy("f32"))
  call = step.__wrapped__ if same_jit else step

  def run(state: Any, batch: Any) -> tuple[Any, jax.Array]:
    state, metrics = call(state, batch)
    return state, metrics["loss"]

  return run, jmp.TrainState.create(params=params, tx=tx)


def variants(model: str, loss_fn: Callable[..., Any], params: Any) -> dict[str, Variant]:
  """The variants that ``model`` runs (see the module docstring)."""
  if model == "tiny":
    sgd, dls = optax.sgd(0.01), jmp.dynamic_loss_scaling(optax.sgd(0.01))
    return {"jax_jit": _jax_jit(loss_fn, params, sgd), "jmp_lite": _jmp_lite(loss_fn, params, sgd),
            "jmp_same_jit": _jmp_lite(loss_fn, params, sgd, same_jit=True),
            "jax_jit_dls": _jax_jit(loss_fn, params, dls),
            "jmp_lite_dls": _jmp_lite(loss_fn, params, dls)}
  adam = optax.adam(1e-3)
  return {"flax": _flax(loss_fn, params, adam), "jmp_lite": _jmp_lite(loss_fn, params, adam)}


# --------------------------------------------------------------------------- #
# Timing
# --------------------------------------------------------------------------- #


def run_model(model: str, args: argparse.Namespace) -> dict[str, Any]:
  """Times ``model``'s variants interleaved; seconds per call, losses and ratios."""
  loss_fn, params, batch = build(model, args.smoke)
  live = variants(model, loss_fn, params)
  states = {name: state for name, (_, state) in live.items()}
  losses: dict[str, list[float]] = {name: [] for name in live}

  def sample(name: str, calls: int) -> tuple[float, float]:
    fn, state = live[name][0], states[name]
    start, thread_start = time.perf_counter(), time.thread_time()
    for _ in range(calls):
      state, loss = fn(state, batch)
    jax.block_until_ready(state)
    elapsed, thread = time.perf_counter() - start, time.thread_time() - thread_start
    states[name] = state
    losses[name].append(float(loss))
    return elapsed / calls, thread / calls

  for name in live:
    for _ in range(args.warmup):
      sample(name, 1)
  first = min(sample(name, 1)[0] for name in live)
  inner = max(1, min(2000, int(args.sample_seconds / max(first, 1e-6))))
  times: dict[str, list[float]] = {name: [] for name in live}
  threads: dict[str, list[float]] = {name: [] for name in live}
  names = list(live)
  for r in range(args.repeats):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      wall, thread = sample(name, inner)
      times[name].append(wall)
      threads[name].append(thread)
  per_call = {n: statistics.median(t) for n, t in times.items()}
  # The variants train the same model from the same start: their losses must agree.
  ref = np.asarray(losses[names[0]])
  loss_diff = max(float(np.max(np.abs(np.asarray(v) - ref) / np.maximum(np.abs(ref), 1e-12)))
                  for v in losses.values())
  return dict(model=model, inner_calls_per_sample=inner, repeats=args.repeats,
              per_call_us={n: t * 1e6 for n, t in per_call.items()},
              samples_us={n: [x * 1e6 for x in t] for n, t in times.items()},
              thread_us={n: statistics.median(t) * 1e6 for n, t in threads.items()},
              max_relative_loss_difference=loss_diff)


def ratios_and_bars(results: list[dict[str, Any]], meaningful: bool) -> tuple[list[Any], list[Any]]:
  """The reported ratios and the checked bars: medians, with the paired median and the mins."""
  by_model = {r["model"]: r for r in results}

  def ratio(model: str, a: str, b: str) -> dict[str, float]:
    samples = by_model[model].get("samples_us")
    if samples is None:  # per-call medians only
      return dict(median=by_model[model]["per_call_us"][a] / by_model[model]["per_call_us"][b])
    return measure.compare(samples[a], samples[b])

  reported = []
  for _, a, b, m in REPORTED:
    if m in by_model:
      r = ratio(m, a, b)
      reported.append(dict(model=m, ratio=f"{a} / {b}", value=r.pop("median"), **r))
  checked = []
  for name, a, b, limit, m in BARS:
    if m in by_model:
      r = ratio(m, a, b)
      checked.append(bars_lib.bar(name, f"{a} / {b} (per call)", r.pop("median"), limit,
                                  meaningful, model=m, **r))
  return reported, checked


# --------------------------------------------------------------------------- #
# Reporting and the command line
# --------------------------------------------------------------------------- #


def markdown(result: dict[str, Any]) -> str:
  """The report: per-call times per model, the reported ratios and the bars."""
  lines = [report.meta_line(result["meta"]), ""]
  for r in result["results"]:
    base = next(iter(r["per_call_us"].values()))
    lines += [f"**{r['model']}**: {r['repeats']} interleaved repeats x "
              f"{r['inner_calls_per_sample']} calls; losses agree within "
              f"{r['max_relative_loss_difference']:.1e} (relative).", "",
              "| variant | per call (us), median | min | max | vs first | calling thread's "
              "CPU (us) |", "|---|---|---|---|---|---|"]
    for name, us in r["per_call_us"].items():
      samples = r["samples_us"][name]
      lines.append(f"| {name} | {us:.1f} | {min(samples):.1f} | {max(samples):.1f} | "
                   f"{us / base:.3f} | {r['thread_us'][name]:.1f} |")
    lines.append("")
  lines += ["| ratio | model | value |", "|---|---|---|"]
  lines += [f"| {x['ratio']} | {x['model']} | {x['value']:.3f} |" for x in result["reported"]]
  lines += ["", *report.bars_table(result["bars"])]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, epilog="models: " + ", ".join(MODELS))
  cli.add_common_arguments(p, "smaller models, 3 repeats, bars not meaningful: a CI check",
                           variants=False)
  p.add_argument("--models", default=",".join(MODELS), metavar="LIST",
                 help="comma-separated models to run (default: %(default)s)")
  cli.add_timing_arguments(p, "--repeats", 41, "; with --smoke 3")
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the benchmark; prints the report and writes JSON and Markdown."""
  argv = sys.argv[1:] if argv is None else argv
  p = build_parser()
  args = p.parse_args(argv)
  try:
    models = cli.choose(args.models, MODELS, MODELS, "model")
  except ValueError as e:
    p.error(f"--models: {e}")
  if args.smoke:
    args.repeats, args.sample_seconds = min(args.repeats, 3), min(args.sample_seconds, 0.01)
  cli.select_platform(args)
  device = cli.device(args, p)
  out = report.output_dir(args.out, args.smoke)
  results = [run_model(m, args) for m in models]
  reported, checked = ratios_and_bars(results, meaningful=not args.smoke)
  result = dict(meta=report.meta(cli.command(PROG, argv), device, smoke=args.smoke),
                config=cli.args_record(args), results=results, reported=reported, bars=checked)
  for b in checked:
    print(report.bar_line(b))
  stem = out / f"call-overhead-{report.machine_name(device)}-{result['meta']['date']}"
  report.publish(result, stem, markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
