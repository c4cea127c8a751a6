"""Train a small Flax CNN on scikit-learn's digits in fp32, bf16 and f16.

    python examples/train_digits.py                          # about 30 s on a 2-core CPU; writes out/
    python examples/train_digits.py --out examples/results   # regenerate the committed results
    python examples/train_digits.py --smoke                  # a few steps, for CI; writes nothing
    python examples/train_digits.py --lean-state             # fp32 vs bf16 masters + 8-bit Adam state

The three runs share the data order and the initial weights; only the precision
changes:

* ``fp32``: policy ``f32`` and plain ``optax.adam``;
* ``bf16``: policy ``mixed_bfloat16`` and plain ``optax.adam`` (bf16 has
  float32's exponent range, so it needs no loss scaling; the step still refuses
  a non-finite update);
* ``f16``:  policy ``mixed_float16`` and ``jmp.dynamic_loss_scaling(adam)``
  starting at 2**15, the usual default.

Three more modes, run by ``--lean-state`` (with ``fp32``, results in
``digits_lean_state.*``), keep the state lean: policy ``mixed_bfloat16``,
bfloat16 master weights with stochastic rounding and Adam's moments in 8 or 4 bits:

* ``bf16_lean_int8``: ``jmp.quantize_state(optax.adam, "int8")``;
* ``bf16_lean_float8``: ``jmp.quantize_state(optax.adam, "float8")``;
* ``bf16_lean_int4``: ``jmp.quantize_state(optax.adam, "int4")``, two codes a byte.

This CNN is small: of its eight leaves only the second convolution's kernel
(4,608 weights) and the first dense kernel (32,768) reach ``quantize_state``'s
default ``min_size`` of 4,096, so the other six (906 weights) keep float32
moments. ``jmp.memory_ledger`` of each run's state is in the table.

The other runs keep float32 master weights in a ``jmp.TrainState``; the half copy
exists only inside the jitted ``jmp.make_train_step``. The script prints test
accuracy, median step time, skipped steps and the final loss scale side by side
and writes ``digits.png`` (loss curves and the f16 loss-scale trajectory),
``digits.md`` and ``digits.json`` to ``--out`` (default ``out/`` at the
repository root, which git ignores).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jmp_lite as jmp

import _common

MODES = ("fp32", "bf16", "f16")  # run by default
# mode -> quantize_state's format; these modes keep bf16 stochastic-rounding masters.
LEAN_STATE = {"bf16_lean_int8": "int8", "bf16_lean_float8": "float8", "bf16_lean_int4": "int4"}
ALL_MODES = MODES + tuple(LEAN_STATE)
POLICIES = {"fp32": "f32", "bf16": "mixed_bfloat16", "f16": "mixed_float16",
            **{mode: "mixed_bfloat16" for mode in LEAN_STATE}}
MASTERS = _common.MASTERS  # --masters: lean master weights


class CNN(nn.Module):
  """Two 3x3 convolutions (16 and 32 filters), 2x2 average pooling, two dense layers.

  Every layer has ``dtype=None``, so it computes in the dtype of the params and
  inputs it is given: the policy's compute dtype.
  """

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


@dataclasses.dataclass(frozen=True)
class Data:
  x_train: np.ndarray  # (n, 8, 8, 1) float32 in [0, 1]
  y_train: np.ndarray  # (n,) int32
  x_test: np.ndarray
  y_test: np.ndarray


def load_data(seed: int = 0) -> Data:
  """``load_digits`` scaled to [0, 1], split 75/25 (stratified, fixed seed)."""
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(
      x, y, test_size=0.25, random_state=seed, stratify=y
  )
  return Data(x_tr, y_tr, x_te, y_te)


def init_params(seed: int = 0):
  """The CNN's initial float32 weights (``init`` under ``jit``: one compilation)."""
  return jax.jit(CNN().init)(jax.random.key(seed), jnp.zeros((1, 8, 8, 1), jnp.float32))


@dataclasses.dataclass
class Result:
  mode: str
  policy: str
  accuracy: float  # test accuracy in percent
  step_ms: float  # median step time after warm-up
  skipped: int  # steps whose gradients were non-finite (not applied)
  final_scale: float
  losses: np.ndarray  # per step, unscaled float32
  scales: np.ndarray  # per step, the scale used for that step
  finite: np.ndarray  # per step, bool
  masters: str = "f32"  # a key of MASTERS
  bytes_per_param: float = 0.0  # jmp.memory_ledger of the final TrainState


def make_tx(mode: str, *, lr: float, init_scale: float, growth_interval: int):
  """Adam for every mode; 8-bit state for the lean-state modes; dynamic loss scaling for f16."""
  tx = optax.adam(lr)
  if mode in LEAN_STATE:
    tx = jmp.quantize_state(tx, LEAN_STATE[mode])
  if mode == "f16":
    tx = jmp.dynamic_loss_scaling(tx, init_scale=init_scale, growth_interval=growth_interval)
  return tx


def run(
    mode: str,
    *,
    epochs: int = 30,
    batch: int = 32,
    seed: int = 0,
    lr: float = 2e-3,
    init_scale: float = 2.0**15,
    growth_interval: int = 200,
    max_steps: int | None = None,
    data: Data | None = None,
    params=None,
    progress: bool = True,
    masters: str = "f32",
) -> Result:
  """Trains the CNN in one precision ``mode`` and returns its :class:`Result`.

  ``data`` defaults to :func:`load_data` and ``params`` (the initial weights) to
  :func:`init_params`, both from ``seed``; pass them to share them across modes.
  ``masters`` picks the master weights (a key of :data:`MASTERS`; bf16 masters
  need a stochastic-rounding key, made from ``seed``). The lean-state modes
  (:data:`LEAN_STATE`) always use ``"bf16-stochastic"`` masters.
  """
  if mode not in ALL_MODES:
    raise ValueError(f"mode must be one of {ALL_MODES}, got {mode!r}")
  if masters not in MASTERS:
    raise ValueError(f"masters must be one of {tuple(MASTERS)}, got {masters!r}")
  if mode in LEAN_STATE:
    if masters not in ("f32", "bf16-stochastic"):
      raise ValueError(f"mode {mode!r} keeps bf16-stochastic masters, got masters={masters!r}")
    masters = "bf16-stochastic"
  if epochs < 1 or batch < 1:
    raise ValueError(f"epochs and batch must be >= 1, got epochs={epochs!r}, batch={batch!r}")
  data = data if data is not None else load_data(seed)
  policy = jmp.get_policy(POLICIES[mode])
  model = CNN()

  def loss_fn(params, batch):
    logits = policy.cast_to_output(model.apply(params, batch["x"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  @jax.jit
  def accuracy(params, x, y):
    logits = model.apply(policy.cast_to_compute(params), policy.cast_to_compute(x))
    return jnp.mean(jnp.argmax(logits, -1) == y)

  # The same initial weights and batch order for every mode. The state gets a
  # private copy of the weights: the train step donates (deletes) its buffers.
  params = jax.tree.map(jnp.copy, params if params is not None else init_params(seed))
  tx = make_tx(mode, lr=lr, init_scale=init_scale, growth_interval=growth_interval)
  lean = dict(MASTERS[masters])
  if lean.get("rounding") == "stochastic":
    lean["key"] = jax.random.key(seed)
  state = jmp.TrainState.create(params=params, tx=tx, **lean)
  step = jmp.make_train_step(loss_fn, policy)

  n = len(data.y_train)
  per_epoch = n // batch  # drop the remainder: one shape, one compilation
  if per_epoch < 1:
    raise ValueError(f"batch must be <= the {n} training examples, got {batch!r}")
  rng = np.random.default_rng(seed)
  order = [rng.permutation(n)[: per_epoch * batch].reshape(per_epoch, batch) for _ in range(epochs)]
  order = np.concatenate(order)[:max_steps]

  times, metrics = [], []
  desc = mode if masters == "f32" else f"{mode}/{masters}"
  bar = _common.progress(order, desc=f"{desc:>4}", total=len(order), enabled=progress)
  for idx in bar:
    b = {"x": data.x_train[idx], "y": data.y_train[idx]}
    (state, m), seconds = _common.timed_step(step, state, b)
    _common.show_skips(bar, m)
    times.append(seconds)
    metrics.append({k: m[k] for k in ("loss", "loss_scale", "grads_finite")})
  metrics = jax.device_get(metrics)
  finite = np.array([m["grads_finite"] for m in metrics], bool)
  acc = accuracy(state.params, data.x_test, data.y_test)
  return Result(
      mode=mode,
      policy=str(policy),
      accuracy=100.0 * float(acc),
      step_ms=_common.median_ms(times, warmup=min(5, len(times) - 1)),
      skipped=int((~finite).sum()),
      final_scale=float(jmp.loss_scale_of(state.opt_state)),
      losses=np.array([m["loss"] for m in metrics], np.float32),
      scales=np.array([m["loss_scale"] for m in metrics], np.float32),
      finite=finite,
      masters=masters,
      bytes_per_param=jmp.memory_ledger(state).bytes_per_param,
  )


def table(results: Sequence[Result]) -> str:
  base = next((r for r in results if r.mode == "fp32"), results[0])
  lean = any(r.masters != "f32" for r in results)  # a masters column only when it varies
  ledger = any(r.mode in LEAN_STATE for r in results)  # and a bytes column with coded state
  rows = [
      [
          r.mode,
          *([r.masters] if lean else []),
          r.policy,
          f"{r.accuracy:.2f}",
          f"{r.step_ms:.2f}",
          f"{r.step_ms / base.step_ms:.2f}x",
          r.skipped,
          f"{r.final_scale:.10g}",
          f"{r.losses[-1]:.4f}",
          *([f"{r.bytes_per_param:.3f}"] if ledger else []),
      ]
      for r in results
  ]
  headers = ["mode", *(["masters"] if lean else []), "policy", "test acc %", "step ms (median)",
             "vs fp32", "skipped steps", "final scale", "last loss",
             *(["state B/param"] if ledger else [])]
  return _common.markdown_table(headers, rows)


def plot(results: Sequence[Result], path: Path, per_epoch: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  f16 = next((r for r in results if r.mode == "f16"), None)  # a loss-scale panel only with f16
  fig, axes = plt.subplots(1, 2 if f16 is not None else 1, figsize=(11 if f16 is not None else 6, 4),
                           squeeze=False)
  ax1 = axes[0, 0]
  window = max(1, min(per_epoch, len(results[0].losses)))
  kernel = np.ones(window) / window
  for r in results:
    smooth = np.convolve(r.losses, kernel, mode="valid")
    name = r.mode if r.masters == "f32" else f"{r.mode}, {r.masters} masters"
    ax1.plot(np.arange(len(smooth)) + window, smooth, label=f"{name} ({r.accuracy:.1f}%)")
  ax1.set(yscale="log", xlabel="step", ylabel=f"train loss (mean of {window} steps)",
          title="Loss curves on load_digits")
  ax1.legend()
  if f16 is not None:
    ax2 = axes[0, 1]
    steps = np.arange(len(f16.scales))
    ax2.step(steps, f16.scales, where="post", label="loss scale used")
    bad = ~f16.finite
    ax2.plot(steps[bad], f16.scales[bad], "rx", label=f"skipped step ({bad.sum()})")
    ax2.set(yscale="log", xlabel="step", ylabel="loss scale",
            title="f16 dynamic loss scale")
    ax2.set_yscale("log", base=2)
    ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = _common.parser(__doc__)
  p.add_argument("--epochs", type=int, default=30, help="passes over the training set per mode "
                 "(default: %(default)s; --smoke: 8 steps)")
  p.add_argument("--batch", type=int, default=32, help="images per step (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the data split, the initial weights and the batch order "
                      "(default: %(default)s)")
  p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default: %(default)s)")
  _common.add_scale_arguments(p)
  _common.add_masters_argument(p, "digits_masters")
  p.add_argument("--lean-state", action="store_true",
                 help="run fp32, bf16_lean_int8, bf16_lean_float8 and bf16_lean_int4 instead "
                      "(bf16 stochastic masters + 8- or 4-bit Adam state; results go to "
                      "digits_lean_state.*)")
  _common.add_output_arguments(p, "8 steps per mode, for CI")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and checks ``argv``; ``out`` becomes the folder to write to, or None."""
  p = build_parser()
  args = p.parse_args(argv)
  if args.epochs < 1 or args.batch < 1:
    p.error(f"--epochs and --batch must be >= 1, got {args.epochs} and {args.batch}")
  args.masters = _common.masters_list(p, args.masters)
  if args.lean_state and args.masters:
    p.error("--lean-state and --masters choose different runs; give one of them")
  args.out = _common.output_dir(args.out, args.smoke)
  return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
  args = parse_args(argv)
  data = load_data(args.seed)
  max_steps = 8 if args.smoke else None
  epochs = 1 if args.smoke else args.epochs
  per_epoch = len(data.y_train) // args.batch
  steps = min(per_epoch * epochs, max_steps or per_epoch * epochs)  # run() drops the remainder
  if args.lean_state:
    runs = [("fp32", "f32")] + [(mode, "bf16-stochastic") for mode in LEAN_STATE]
  else:
    runs = [(mode, "f32") for mode in MODES] + [("bf16", m) for m in args.masters]
  print(f"load_digits: {len(data.y_train)} train / {len(data.y_test)} test images; "
        f"{steps} steps of batch {args.batch} per run; runs "
        f"{', '.join(m if w == 'f32' else f'{m}/{w}' for m, w in runs)}; {_common.machine()}",
        flush=True)
  _common.announce_output(args.out)
  params = init_params(args.seed)
  results = [
      run(mode, epochs=epochs, batch=args.batch, seed=args.seed, lr=args.lr,
          init_scale=args.init_scale, growth_interval=args.growth_interval,
          max_steps=max_steps, data=data, params=params, progress=not args.no_progress,
          masters=masters)
      for mode, masters in runs
  ]
  text = table(results)
  print()
  print(text)
  base = results[0].accuracy
  gap = max(abs(r.accuracy - base) for r in results[1:])
  print(f"\nlargest accuracy gap to fp32: {gap:.2f} points "
        f"({'within' if gap <= 1.0 else 'NOT within'} 1 point)")
  for r in results:
    if r.masters != "f32":
      diff = r.accuracy - base
      what = f"{r.mode} ({r.bytes_per_param:.3f} B/param)" if r.mode in LEAN_STATE else (
          f"{r.masters} masters")
      print(f"  {what}: {diff:+.2f} points vs fp32 "
            f"({'within' if abs(diff) <= 1.0 else 'NOT within'} 1 point)")

  out = args.out
  if out is None:
    print("smoke run: no files written (pass --out DIR to write them)")
    return results
  name = "digits_lean_state" if args.lean_state else "digits_masters" if args.masters else "digits"
  png = out / f"{name}.png"
  out.mkdir(parents=True, exist_ok=True)
  plot(results, png, per_epoch=per_epoch)
  payload = {
      "config": _common.args_record(args),
      "steps_per_mode": len(results[0].losses),
      "results": [
          {k: v for k, v in dataclasses.asdict(r).items() if not isinstance(v, np.ndarray)}
          for r in results
      ],
  }
  written = _common.write_results(out, name, text, payload)
  print("wrote " + ", ".join(str(p) for p in [png, *written]))
  return results


if __name__ == "__main__":
  main()
