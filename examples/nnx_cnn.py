"""A converted NNX training script: a CNN with BatchNorm and Dropout on load_digits, four ways.

    python examples/nnx_cnn.py                          # about 20 s on a 2-core CPU; writes out/
    python examples/nnx_cnn.py --out examples/results   # regenerate the committed results
    python examples/nnx_cnn.py --smoke                  # a few steps, for CI; writes nothing

The model is written the way NNX users write it (``nnx.Conv``, ``nnx.BatchNorm``,
``nnx.Dropout``, ``nnx.Linear``, max and average pooling, an ``nnx.Rngs``
dropout stream) and is ported as ``docs/porting.md`` shows: ``nnx.split`` into
params and the rest (BatchNorm statistics, RNG counts), ``loss_fn(params, rest,
batch)`` returning the new rest, ``jmp.make_train_step``. Four modes share the
data order and the initial weights:

* ``fp32``: policy ``f32``, plain ``optax.adam``;
* ``f16``: ``mixed_float16`` with ``jmp.dynamic_loss_scaling``;
* ``f16_autocast``: the same with ``autocast=True``;
* ``bf16``: ``mixed_bfloat16``, plain ``optax.adam``.

The BatchNorm statistics stay float32 in every mode (the step never casts the
model state). NNX's BatchNorm promotes its output to them, so under plain
``mixed_float16`` the layers after it compute in float32; the precision report
printed per mode shows it, and autocast runs them in half. The script writes
``nnx_cnn.md`` and ``nnx_cnn.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_lite as jmp

import _common
import train_digits

MODES = {  # name: (policy, autocast, dynamic loss scaling)
    "fp32": ("f32", False, False),
    "f16": ("mixed_float16", False, True),
    "f16_autocast": ("mixed_float16", True, True),
    "bf16": ("mixed_bfloat16", False, False),
}


class CNN(nnx.Module):
  """Conv-BatchNorm-ReLU twice, max and average pooling, Dropout, two Linear layers."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.bn1 = nnx.BatchNorm(16, rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
    self.bn2 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.linear1 = nnx.Linear(32 * 2 * 2, 64, rngs=rngs)
    self.linear2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.max_pool(nnx.relu(self.bn1(self.conv1(x))), (2, 2), strides=(2, 2))
    x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), (2, 2), strides=(2, 2))
    x = self.dropout(x.reshape(x.shape[0], -1))
    return self.linear2(nnx.relu(self.linear1(x)))


@dataclasses.dataclass
class Result:
  mode: str
  policy: str
  accuracy: float  # test accuracy, percent
  step_ms: float
  skipped: int
  final_scale: float
  last_loss: float
  report: str  # the precision report of the loss function, as printed


def split_model(seed: int) -> tuple[Any, Any, Any]:
  """``(graphdef, params, rest)`` of a fresh model in training mode."""
  model = CNN(nnx.Rngs(params=seed, dropout=seed + 1))
  model.train()
  return nnx.split(model, nnx.Param, ...)


def make_loss_fn(graphdef: Any):
  """``loss_fn(params, rest, batch) -> (loss, new rest)``, the float32 cross-entropy."""

  def loss_fn(params: Any, rest: Any, batch: dict[str, Any]) -> tuple[jax.Array, Any]:
    model = nnx.merge(graphdef, params, rest)
    logits = model(batch["x"]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  return loss_fn


def evaluate(graphdef: Any, state: jmp.TrainState, policy: jmp.Policy, autocast: bool,
             x: np.ndarray, y: np.ndarray) -> float:
  """Test accuracy (percent) in the mode's compute dtype, BatchNorm on its running statistics."""
  model = nnx.merge(graphdef, policy.cast_to_compute(state.params), state.model_state)
  model.eval()
  apply = lambda m, v: m(v)
  if autocast:
    apply = jmp.autocast(apply, policy.compute_dtype)
  logits = apply(model, jnp.asarray(x, policy.compute_dtype))
  return 100.0 * float(jnp.mean(jnp.argmax(logits, -1) == y))


def run(mode: str, *, data: train_digits.Data, steps: int, batch: int, seed: int, lr: float,
        progress: bool = True) -> Result:
  """Trains one mode for ``steps`` steps and evaluates it."""
  policy_name, autocast, scaled = MODES[mode]
  policy = jmp.get_policy(policy_name)
  graphdef, params, rest = split_model(seed)
  loss_fn = make_loss_fn(graphdef)
  tx = optax.adam(lr)
  if scaled:
    tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**15)
  state = jmp.TrainState.create(params=params, tx=tx, model_state=rest)
  step = jmp.make_train_step(loss_fn, policy, autocast=autocast)
  order = np.random.default_rng(seed).integers(0, len(data.y_train), (steps, batch))
  times, finite = [], []
  bar = _common.progress(order, desc=f"{mode:>12}", total=steps, enabled=progress)
  for idx in bar:
    (state, m), seconds = _common.timed_step(
        step, state, {"x": data.x_train[idx], "y": data.y_train[idx]})
    _common.show_skips(bar, m)
    times.append(seconds)
    finite.append(bool(m["grads_finite"]))
  sample = {"x": data.x_train[:batch], "y": data.y_train[:batch]}
  report = jmp.precision_report(loss_fn, params, sample, policy=policy, autocast=autocast,
                                model_state=rest)
  return Result(
      mode=mode, policy=str(policy),
      accuracy=evaluate(graphdef, state, policy, autocast, data.x_test, data.y_test),
      step_ms=_common.median_ms(times, warmup=min(5, len(times) - 1)),
      skipped=int(steps - sum(finite)),
      final_scale=float(jmp.loss_scale_of(state.opt_state)),
      last_loss=float(m["loss"]),
      report=str(report),
  )


def table(results: Sequence[Result]) -> str:
  base = results[0]
  rows = [[r.mode, r.policy, f"{r.accuracy:.2f}", f"{r.step_ms:.2f}",
           f"{r.step_ms / base.step_ms:.2f}x", r.skipped, f"{r.final_scale:g}",
           f"{r.last_loss:.4f}"] for r in results]
  headers = ["mode", "policy", "test acc %", "step ms (median)", "vs fp32", "skipped steps",
             "final scale", "last loss"]
  return _common.markdown_table(headers, rows)


def reports(results: Sequence[Result]) -> str:
  """The precision report of each mode, as fenced text blocks."""
  return "\n\n".join(f"{r.mode}:\n\n```text\n{r.report}\n```" for r in results)


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = _common.parser(__doc__)
  p.add_argument("--steps", type=int, default=600,
                 help="train steps per mode (default: %(default)s; --smoke: 6)")
  p.add_argument("--batch", type=int, default=32, help="images per step (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the split, the initial weights and the batches (default: %(default)s)")
  p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default: %(default)s)")
  _common.add_output_arguments(p, "6 steps per mode, for CI")
  return p


def main(argv: Sequence[str] | None = None) -> list[Result]:
  p = build_parser()
  args = p.parse_args(argv)
  if args.steps < 1 or args.batch < 1:
    p.error(f"--steps and --batch must be >= 1, got {args.steps} and {args.batch}")
  args.out = _common.output_dir(args.out, args.smoke)
  steps = 6 if args.smoke else args.steps
  data = train_digits.load_data(args.seed)
  print(f"load_digits: {len(data.y_train)} train / {len(data.y_test)} test images; NNX CNN "
        f"with BatchNorm and Dropout; {steps} steps of batch {args.batch} per mode; "
        f"{_common.machine()}", flush=True)
  _common.announce_output(args.out)
  results = [run(mode, data=data, steps=steps, batch=args.batch, seed=args.seed, lr=args.lr,
                 progress=not args.no_progress) for mode in MODES]
  text = table(results)
  print()
  print(text)
  print()
  print(reports(results))
  if args.out is None:
    print("smoke run: no files written (pass --out DIR to write them)")
    return results
  payload = {"config": _common.args_record(args), "steps_per_mode": steps,
             "results": [dataclasses.asdict(r) for r in results]}
  for path in _common.write_results(args.out, "nnx_cnn", text + "\n\n" + reports(results),
                                    payload):
    print(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
