"""The underflow story: f16 gradients flush to zero without loss scaling.

    python examples/underflow.py                          # about a minute on a laptop CPU; writes out/
    python examples/underflow.py --out examples/results   # regenerate the committed results
    python examples/underflow.py --smoke                  # a few steps, for CI; writes nothing

A three-layer tanh MLP (16 -> 64 -> 64 -> 32, last layer zero-initialised)
regresses a small-magnitude target: a fixed random tanh network scaled so that
the targets have a standard deviation of about 6e-5 (think of a correction term
in physical units). The loss is the mean squared error over a batch of 512 x 32
outputs, so the gradient that enters the backward pass is
``d loss / d pred = 2 * err / 16384``, about 2^-27: below float16's smallest
subnormal, 2^-24. Three runs share the data, the batch order and the initial
weights:

* ``fp32``: policy ``f32``, plain Adam: the reference;
* ``f16, no scaling``: policy ``mixed_float16`` and
  ``jmp.static_loss_scaling(adam, 1.0)``: every backward cotangent flushes to 0;
* ``f16, dynamic``: policy ``mixed_float16`` and ``jmp.dynamic_loss_scaling(adam)``
  from 2^15.

The script prints, side by side, the first and last loss, the fraction of the
f16 parameter gradients that are exactly zero (``jmp.gradient_report``), the
final loss scale and the skipped steps. It writes
``underflow_histograms.png``: the histogram of log2|g| of the fp32 run's
gradients against float16's range, at scale 1 and at the suggested scale, side
by side; ``underflow.md``/``underflow.json`` (the table); and
``precision_lint.txt``: ``jmp.precision_lint`` over this model and the digits
CNN of ``train_digits.py``. Files go to ``--out`` (default ``out/`` at the
repository root, which git ignores).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp

import _common

MODES = ("fp32", "f16, no scaling", "f16, dynamic")
POLICIES = {"fp32": "f32", "f16, no scaling": "mixed_float16", "f16, dynamic": "mixed_float16"}
FEATURES, HIDDEN, OUTPUTS = 16, 64, 32
TARGET_SCALE = 1e-4


class MLP(nn.Module):
  """16 -> 64 -> 64 -> 32 with tanh; the last layer starts at zero.

  Every layer has ``dtype=None``: it computes in the dtype of the params and
  inputs it gets, the policy's compute dtype.
  """

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.tanh(nn.Dense(HIDDEN)(x))
    x = nn.tanh(nn.Dense(HIDDEN)(x))
    return nn.Dense(OUTPUTS, kernel_init=nn.initializers.zeros)(x)


MODEL = MLP()


def make_data(n: int = 4096, seed: int = 0) -> dict[str, np.ndarray]:
  """Gaussian inputs and the small targets of a fixed random tanh network."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, FEATURES)).astype(np.float32)
  a = rng.normal(size=(FEATURES, HIDDEN)) / 4
  b = rng.normal(size=(HIDDEN, OUTPUTS)) / 8
  y = TARGET_SCALE * np.tanh(x @ a) @ b
  return {"x": x, "y": y.astype(np.float32)}


def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean squared error, computed in float32 from the compute-dtype prediction."""
  pred = MODEL.apply(params, batch["x"])
  return jnp.mean((pred.astype(jnp.float32) - batch["y"].astype(jnp.float32)) ** 2)


def init_params(seed: int = 0) -> Any:
  return MODEL.init(jax.random.key(seed), jnp.zeros((1, FEATURES), jnp.float32))


def make_tx(mode: str, lr: float = 1e-5) -> Any:
  if mode == "fp32":
    return optax.adam(lr)
  if mode == "f16, no scaling":
    return jmp.static_loss_scaling(optax.adam(lr), 1.0)
  if mode == "f16, dynamic":
    return jmp.dynamic_loss_scaling(optax.adam(lr), init_scale=2.0**15, growth_interval=100)
  raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def step_grads(params: Any, batch: Any, policy: jmp.Policy, scale: jax.Array) -> Any:
  """The unscaled gradients exactly as ``make_train_step`` computes them."""
  batch = policy.cast_to_compute(batch)
  scaled = jax.grad(lambda p: loss_fn(policy.cast_to_compute(p), batch).astype(jnp.float32) * scale)
  return jax.tree.map(lambda g: g / scale, scaled(params))


@dataclasses.dataclass(frozen=True)
class Result:
  mode: str
  losses: np.ndarray  # per step, unscaled float32
  zero_first: float   # fraction of exactly-zero gradients at the first step
  zero_last: float    # ... and at the last step
  final_scale: float
  skipped: int
  params: Any


def batches(data: dict[str, np.ndarray], steps: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
  """``steps`` random batches, stacked: the same order for every mode."""
  idx = np.random.default_rng(seed).integers(0, len(data["x"]), size=(steps, batch_size))
  return {k: v[idx] for k, v in data.items()}


def train(
    mode: str,
    data: dict[str, np.ndarray],
    *,
    steps: int = 600,
    batch_size: int = 512,
    chunk: int = 50,
    seed: int = 0,
    progress: bool = False,
) -> Result:
  """Trains one mode with ``jmp.make_train_step``, ``chunk`` steps per ``lax.scan``."""
  policy = jmp.get_policy(POLICIES[mode])
  state = jmp.TrainState.create(params=init_params(seed), tx=make_tx(mode))
  step = jmp.make_train_step(loss_fn, policy, donate=False)

  @jax.jit
  def run_chunk(state, xs):
    return jax.lax.scan(step, state, xs)

  @jax.jit
  def zero_fraction(params, batch, scale):
    return jmp.gradient_report(step_grads(params, batch, policy, scale)).zero_fraction

  all_batches = batches(data, steps, batch_size, seed)
  first = jax.tree.map(lambda v: v[0], all_batches)
  zero_first = float(zero_fraction(state.params, first, jmp.loss_scale_of(state.opt_state)))
  losses, skipped = [], 0
  starts = range(0, steps, chunk)
  for start in _common.progress(starts, desc=mode, total=len(starts), enabled=progress):
    xs = jax.tree.map(lambda v: v[start:start + chunk], all_batches)
    state, metrics = run_chunk(state, xs)
    losses.append(np.asarray(metrics["loss"]))
    # Every mode counts its skips (plain optax fp32 has no scaler to count them).
    skipped += int((~np.asarray(metrics["grads_finite"])).sum())
  last = jax.tree.map(lambda v: v[-1], all_batches)
  scale = metrics["loss_scale"][-1]
  return Result(
      mode=mode,
      losses=np.concatenate(losses),
      zero_first=zero_first,
      zero_last=float(zero_fraction(state.params, last, scale)),
      final_scale=float(jmp.loss_scale_of(state.opt_state)),
      skipped=skipped,
      params=state.params,
  )


def table(results: Sequence[Result]) -> str:
  rows = [
      [r.mode, f"{r.losses[0]:.3e}", f"{r.losses[-1]:.3e}", f"{r.zero_first:.1%}",
       f"{r.zero_last:.1%}", f"{r.final_scale:g}", r.skipped]
      for r in results
  ]
  return _common.markdown_table(
      ["run", "first loss", "last loss", "zero grads (first step)", "zero grads (last step)",
       "final scale", "skipped steps"],
      rows,
  )


def histograms(params: Any, data: dict[str, np.ndarray], path: Path, batch_size: int = 512) -> tuple:
  """fp32 gradients at ``params``, drawn at scale 1 and at the suggested scale."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  batch = {k: v[:batch_size] for k, v in data.items()}
  grads = jax.grad(loss_fn)(params, batch)
  at_one = jmp.gradient_report(grads, dtype=jnp.float16, loss_scale=1.0)
  suggested = at_one.suggested_loss_scale
  at_suggested = jmp.gradient_report(grads, dtype=jnp.float16, loss_scale=suggested)
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
  at_one.plot(ax=axes[0])
  at_suggested.plot(ax=axes[1])
  fig.suptitle("log2 |gradient| of the fp32 run against float16's range", fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return at_one, at_suggested


def lint_text() -> str:
  """``jmp.precision_lint`` over this MLP and the digits CNN, under mixed_float16."""
  import train_digits

  data = make_data(64)
  cnn = train_digits.CNN()
  cnn_params = cnn.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
  digits = {"x": np.zeros((32, 8, 8, 1), np.float32), "y": np.zeros((32,), np.int32)}
  policy = jmp.get_policy("mixed_float16")

  def digits_loss(params, batch):  # As in train_digits.py: logits cast to f32.
    logits = policy.cast_to_output(cnn.apply(params, batch["x"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  def digits_loss_f16(params, batch):  # The same loss without the cast.
    logits = cnn.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  cases = [
      ("underflow MLP (examples/underflow.py: loss_fn)", loss_fn, init_params(), data),
      ("digits CNN (examples/train_digits.py: loss_fn)", digits_loss, cnn_params, digits),
      ("digits CNN, cross-entropy on f16 logits", digits_loss_f16, cnn_params, digits),
  ]
  out = []
  for title, fn, params, batch in cases:
    findings = jmp.precision_lint(fn, params, batch, policy=policy)
    out.append(f"== {title}, policy {policy}: {len(findings)} finding(s)")
    out.extend(str(f) for f in findings)
  return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = _common.parser(__doc__)
  p.add_argument("--steps", type=int, default=600,
                 help="train steps per run (default: %(default)s; --smoke: 8)")
  p.add_argument("--smoke", action="store_true", help="a few steps per run, for CI")
  p.add_argument("--out", type=Path, default=None, help=_common.OUT_HELP)
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and checks ``argv``; ``out`` becomes the folder to write to, or None."""
  p = build_parser()
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  args.out = _common.output_dir(args.out, args.smoke)
  return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
  args = parse_args(argv)
  steps, chunk = (8, 4) if args.smoke else (args.steps, 50)
  data = make_data()
  print(f"{len(data['x'])} synthetic examples ({FEATURES} -> {OUTPUTS}, targets of std "
        f"{data['y'].std():.1e}); a {FEATURES}-{HIDDEN}-{HIDDEN}-{OUTPUTS} tanh MLP, {steps} steps of "
        f"batch 512 per run; runs {', '.join(MODES)}; {_common.machine()}", flush=True)
  _common.announce_output(args.out)
  results = [train(m, data, steps=steps, chunk=chunk, progress=not args.smoke) for m in MODES]
  text = table(results)
  print(text)
  lint = lint_text()
  print("\nprecision_lint, mixed_float16:\n" + lint)
  out = args.out
  if out is None:
    print("smoke run: no files written (pass --out DIR to write them)")
    return results
  out.mkdir(parents=True, exist_ok=True)
  at_one, at_suggested = histograms(results[0].params, data, out / "underflow_histograms.png")
  print("\ngradient_report of the fp32 run's gradients:\n" + at_one.summary())
  print("\n... at the suggested scale:\n" + at_suggested.summary())
  (out / "precision_lint.txt").write_text(lint + "\n")
  payload = {
      "steps": steps,
      "runs": [
          {"mode": r.mode, "first_loss": float(r.losses[0]), "last_loss": float(r.losses[-1]),
           "zero_grads_first": r.zero_first, "zero_grads_last": r.zero_last,
           "final_scale": r.final_scale, "skipped": r.skipped}
          for r in results
      ],
      "fp32_grads_at_scale_1": {"underflow": float(at_one.underflow_fraction),
                                "suggested_scale": float(at_one.suggested_loss_scale)},
  }
  written = _common.write_results(out, "underflow", text, payload)
  for path in [*written, out / "underflow_histograms.png", out / "precision_lint.txt"]:
    print(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
