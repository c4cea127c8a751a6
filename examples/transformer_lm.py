"""A byte-level Transformer language model, trained four ways: fp32, params-only f16, autocast.

Two more modes, FP8 matmuls through autocast, run when named (``--modes``).

    python examples/transformer_lm.py                          # a few minutes on a 2-core CPU; writes out/
    python examples/transformer_lm.py --out examples/results   # regenerate the committed results
    python examples/transformer_lm.py --smoke                  # seconds, for CI; writes nothing
    python examples/transformer_lm.py --modes autocast_bf16 fp8_bf16 fp8_f16   # FP8 vs bf16

The model is written the natural way, with no casts anywhere: a Flax Linen
decoder (token and position embeddings, pre-LayerNorm blocks of causal
multi-head attention and a GELU MLP, a final LayerNorm and a read-out), and the
loss is ``optax.softmax_cross_entropy_with_integer_labels(...).mean()``
(``--loss naive`` writes it as the issue's ``exp(logits) / sum(exp(logits))``
instead, with results named ``transformer_lm_naive.*``). The
corpus is the Python standard library's own ``*.py`` sources, as in
``char_lm.py`` (first 90 % train, last 10 % validation); each step trains on
random windows of the training text.

The four runs share the initial weights and the data order; only the precision
changes:

* ``fp32``: policy ``f32``;
* ``mixed_f16``: policy ``mixed_float16``, today's params-only way: the step
  casts the params and the batch to float16 and every op runs in float16;
* ``autocast_f16``: the same policy with ``make_train_step(..., autocast=True)``:
  matmuls in float16, softmax, LayerNorm statistics, the loss and every other
  float32-list op in float32;
* ``autocast_bf16``: policy ``mixed_bfloat16`` with ``autocast=True``;
* ``fp8_bf16`` and ``fp8_f16`` (not run by default): ``autocast=True,
  fp8=jmp.Float8Recipe(min_size=0)`` with ``mixed_bfloat16`` and
  ``mixed_float16``: every matmul on float8 operands, however small (the
  default ``min_size`` would keep all of this model's in half), with per-tensor
  current scaling, the rest as autocast. Without a
  GPU with FP8 tensor cores, XLA emulates them (slower than bf16). Their
  results are named ``transformer_lm_fp8.*``;
* ``fp8_bf16_keep_ends`` and ``fp8_bf16_rowwise`` (not run by default): FP8
  steered with a ``jmp.Float8Recipe``: the first block and the read-out kept in
  bf16 (``keep=r"params/(?:Block_0|Dense_0)/"``), or one scale per row
  (``scaling="rowwise"``).
* ``bf16_lean_int8``, ``bf16_lean_float8`` and ``bf16_lean_int4`` (not run by
  default): policy ``mixed_bfloat16``, bfloat16 master weights with
  stochastic rounding and AdamW's moments stored in 8 or 4 bits by
  ``jmp.quantize_state`` (about 4 or 3 bytes per parameter instead of 12).
  Their results are named ``transformer_lm_lean_state.*``.

The f16 runs use ``jmp.dynamic_loss_scaling`` (from 2**15); all four use AdamW
with gradient clipping and float32 master weights. The script prints
validation bits per byte, step times, skipped steps and the final loss scale,
and writes ``transformer_lm.md``, ``transformer_lm.json`` and
``transformer_lm.png`` (training loss curves) to ``--out`` (default ``out/`` at
the repository root, which git ignores; pass ``--out examples/results`` to
regenerate the committed results).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp

import _common
from char_lm import load_corpus, split

VOCAB = 256  # bytes
NAME = "transformer_lm"
# mode: (policy, autocast, fp8)
MODES = {
    "fp32": ("f32", False, False),
    "mixed_f16": ("mixed_float16", False, False),
    "autocast_f16": ("mixed_float16", True, False),
    "autocast_bf16": ("mixed_bfloat16", True, False),
    # Every matmul in FP8 (min_size=0): this model's GEMMs are far below the
    # default min_size (4096), from which FP8 pays on an H100.
    "fp8_bf16": ("mixed_bfloat16", True, jmp.Float8Recipe(min_size=0)),
    "fp8_f16": ("mixed_float16", True, jmp.Float8Recipe(min_size=0)),
    # FP8 steered (issue 30): the first block and the read-out kept in bf16, as
    # Megatron's --first-last-layers-bf16 does; or one scale per row.
    "fp8_bf16_keep_ends": ("mixed_bfloat16", True,
                           jmp.Float8Recipe(min_size=0, keep=r"params/(?:Block_0|Dense_0)/")),
    "fp8_bf16_rowwise": ("mixed_bfloat16", True,
                         jmp.Float8Recipe(min_size=0, scaling="rowwise")),
    # Lean state (issues 35, 45): bf16 masters with stochastic rounding, AdamW's moments in 8
    # or 4 bits.
    "bf16_lean_int8": ("mixed_bfloat16", False, False),
    "bf16_lean_float8": ("mixed_bfloat16", False, False),
    "bf16_lean_int4": ("mixed_bfloat16", False, False),
}
# mode -> quantize_state's format; these modes keep bf16 stochastic-rounding masters.
LEAN_STATE = {"bf16_lean_int8": "int8", "bf16_lean_float8": "float8", "bf16_lean_int4": "int4"}
DEFAULT_MODES = ("fp32", "mixed_f16", "autocast_f16", "autocast_bf16")


class Block(nn.Module):
  """Pre-LayerNorm decoder block: causal self-attention and a GELU MLP."""

  d_model: int
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.LayerNorm()(x)
    return x + nn.Dense(self.d_model)(nn.gelu(nn.Dense(4 * self.d_model)(h)))


class TransformerLM(nn.Module):
  """Byte embeddings plus learned positions, ``layers`` blocks, a read-out."""

  d_model: int = 128
  layers: int = 2
  heads: int = 4
  max_len: int = 128

  @nn.compact
  def __call__(self, tokens):
    positions = self.param("positions", nn.initializers.normal(0.02),
                           (self.max_len, self.d_model))
    x = nn.Embed(VOCAB, self.d_model)(tokens) + positions[: tokens.shape[-1]]
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = Block(self.d_model, self.heads)(x, mask)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


@dataclasses.dataclass
class Result:
  mode: str
  policy: str
  autocast: bool
  fp8: str  # "" (off), or the recipe: "fp8", "fp8 rowwise", "fp8 keep <rules>"
  valid_bpb: float  # bits per byte on the validation text
  train_loss: float  # mean of the last 50 steps, nats per byte
  step_ms: float
  skipped: int
  final_scale: float
  losses: np.ndarray
  finite: np.ndarray
  # --schedule wsd: validation bits/byte through the decay (its first step to its last), and
  # the largest rise over the lowest value before it, relative.
  decay_bpb: list[float] = dataclasses.field(default_factory=list)
  decay_rise: float = 0.0


def describe_fp8(fp8: Any) -> str:
  """A mode's FP8 setting in words, for the table.

  Examples:
    >>> describe_fp8(False), describe_fp8(True), describe_fp8(jmp.Float8Recipe(scaling="rowwise"))
    ('', 'fp8', 'fp8 rowwise')
    >>> describe_fp8(jmp.Float8Recipe(min_size=0, keep="Block_0"))
    'fp8 min_size 0 keep Block_0'
  """
  recipe = jmp.Float8Recipe() if fp8 is True else fp8
  if not recipe:
    return ""
  words = ["fp8"] + (["rowwise"] if recipe.scaling == "rowwise" else [])
  words += [f"min_size {recipe.min_size}"] if recipe.min_size != jmp.Float8Recipe().min_size else []
  words += [f"keep {' '.join(map(str, recipe.keep))}"] if recipe.keep else []
  return " ".join(words)


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """Inputs and next-byte targets of the windows starting at ``starts``."""
  idx = starts[:, None] + np.arange(seq_len + 1)
  chunk = tokens[idx]
  return {"x": chunk[:, :-1], "y": chunk[:, 1:]}


def loss_fn(model: TransformerLM, params, batch, naive: bool = False) -> jax.Array:
  """Mean cross-entropy; ``naive`` writes the softmax as exp(logits) / sum(exp(logits))."""
  logits = model.apply(params, batch["x"])
  if naive:  # the example: exp overflows float16 once a logit exceeds 11.1
    probs = jnp.exp(logits) / jnp.sum(jnp.exp(logits), axis=-1, keepdims=True)
    return -jnp.mean(jnp.log(jnp.take_along_axis(probs, batch["y"][..., None], axis=-1)))
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def evaluate(model, policy, autocast, params, valid: np.ndarray, seq_len: int, batch: int,
             fp8: Any = False) -> float:
  """Bits per byte over the validation text, in the mode's precision."""
  apply = model.apply
  if autocast:
    apply = jmp.autocast(apply, policy.compute_dtype, fp8=fp8)

  @jax.jit
  def nll(params, b):
    logits = apply(policy.cast_to_compute(params), b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), b["y"]).sum()

  starts = np.arange(0, len(valid) - seq_len - 1, seq_len)
  starts = starts[: len(starts) // batch * batch]
  total = sum(float(nll(params, windows(valid, s, seq_len)))
              for s in starts.reshape(-1, batch))
  return total / (len(starts) * seq_len) / math.log(2)


SCHEDULES = ("cosine", "wsd")
DECAY_EVALS = 11  # --schedule wsd: validations through the decay, its first step and its last


def learning_rate(schedule: str, lr: float, steps: int) -> optax.Schedule:
  """AdamW's learning rate: a warmup over the first 5% of ``steps``, then a cosine decay to
  ``lr / 10`` (``"cosine"``) or ``lr`` held and then cut linearly to 0 over the last 10%
  (``"wsd"``, warmup-stable-decay).

  Examples:
    >>> f = learning_rate("wsd", 1.0, 100)
    >>> [float(f(t)) for t in (0, 5, 50, 90, 95, 100)]
    [0.0, 1.0, 1.0, 1.0, 0.5, 0.0]
  """
  warmup = max(1, steps // 20)
  if schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr / 10)
  if schedule != "wsd":
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
  decay = max(1, steps // 10)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr),
       optax.linear_schedule(lr, 0.0, decay)], [warmup, steps - decay])


def decay_evals(schedule: str, steps: int) -> list[int]:
  """The steps after which ``run`` validates through a ``"wsd"`` decay (none for ``"cosine"``)."""
  if schedule != "wsd":
    return []
  start = steps - max(1, steps // 10)
  return sorted({int(round(start + i * (steps - start) / (DECAY_EVALS - 1)))
                 for i in range(DECAY_EVALS)})


def rise(values: Sequence[float]) -> float:
  """The largest rise of ``values`` over the lowest value before it, relative.

  Examples:
    >>> round(rise([2.0, 1.9, 1.919, 1.8]), 6)
    0.01
  """
  low, worst = math.inf, 0.0
  for v in values:
    if low < math.inf:
      worst = max(worst, v / low - 1)
    low = min(low, v)
  return worst


def run(mode: str, model: TransformerLM, params, train: np.ndarray, valid: np.ndarray, *,
        steps: int, batch: int, seq_len: int, lr: float, seed: int, naive: bool = False,
        progress: bool = True, trained: dict[str, Any] | None = None,
        schedule: str = "cosine") -> Result:
  """Trains ``model`` from ``params`` for ``steps`` steps in precision ``mode``.

  With ``trained`` (a dict), its ``"params"`` entry receives the final params.
  With ``schedule="wsd"`` the validation bits/byte is also measured through the
  decay (:func:`decay_evals`).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
  policy_name, autocast, fp8 = MODES[mode]
  policy = jmp.get_policy(policy_name)
  schedule_fn = learning_rate(schedule, lr, steps)
  adamw = optax.adamw(schedule_fn, weight_decay=0.01)
  lean: dict[str, Any] = {}
  if mode in LEAN_STATE:
    adamw = jmp.quantize_state(adamw, LEAN_STATE[mode])
    lean = dict(master_dtype=jnp.bfloat16, rounding="stochastic", key=jax.random.key(seed))
  tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
  if policy.compute_dtype == jnp.float16:
    tx = jmp.dynamic_loss_scaling(tx, init_scale=2.0**15)
  state = jmp.TrainState.create(params=params, tx=tx, **lean)
  step = jmp.make_train_step(lambda p, b: loss_fn(model, p, b, naive), policy, autocast=autocast,
                             fp8=fp8)

  rng = np.random.default_rng(seed)  # the same data order in every mode
  times, metrics, decay_bpb = [], [], []
  evals = set(decay_evals(schedule, steps))
  validate = lambda p: evaluate(model, policy, autocast, p, valid, seq_len, batch, fp8)
  bar = _common.progress(range(steps), desc=f"{mode:>13}", total=steps, enabled=progress)
  for t in bar:
    if t in evals:  # before step t: after t steps
      decay_bpb.append(validate(state.params))
    b = windows(train, rng.integers(0, len(train) - seq_len - 1, batch), seq_len)
    (state, m), seconds = _common.timed_step(step, state, b)
    _common.show_skips(bar, m)
    times.append(seconds)
    metrics.append({k: m[k] for k in ("loss", "grads_finite")})
  valid_bpb = validate(state.params)
  if steps in evals:
    decay_bpb.append(valid_bpb)
  metrics = jax.device_get(metrics)
  if trained is not None:
    trained["params"] = state.params
  losses = np.array([m["loss"] for m in metrics], np.float32)
  finite = np.array([bool(m["grads_finite"]) for m in metrics])
  return Result(
      mode=mode,
      policy=str(policy),
      autocast=autocast,
      fp8=describe_fp8(fp8),
      valid_bpb=valid_bpb,
      train_loss=float(losses[-50:].mean()),
      step_ms=_common.median_ms(times, warmup=min(5, len(times) - 1)),
      skipped=int((~finite).sum()),
      final_scale=float(jmp.loss_scale_of(state.opt_state)),
      losses=losses,
      finite=finite,
      decay_bpb=decay_bpb,
      decay_rise=rise(decay_bpb),
  )


def table(results: Sequence[Result]) -> str:
  base = next((r for r in results if r.mode == "fp32"), results[0])
  rows = [
      [
          r.mode,
          r.policy,
          (f"yes, {r.fp8}" if r.fp8 else "yes") if r.autocast else "no",
          f"{r.valid_bpb:.4f}",
          f"{100 * (r.valid_bpb / base.valid_bpb - 1):+.2f}%",
          f"{r.train_loss:.3f}",
          f"{r.step_ms:.1f}",
          f"{r.step_ms / base.step_ms:.2f}x",
          r.skipped,
          f"{r.final_scale:.10g}",
          *([f"{100 * r.decay_rise:.2f}%"] if base.decay_bpb else []),
      ]
      for r in results
  ]
  headers = ["mode", "policy", "autocast", "valid bits/byte", f"vs {base.mode}",
             "train loss (last 50)", "step ms (median)", f"time vs {base.mode}", "skipped steps",
             "final scale", *(["rise in the decay"] if base.decay_bpb else [])]
  return _common.markdown_table(headers, rows)


def plot(results: Sequence[Result], path: Path, loss: str) -> None:
  """Training loss curves (left) and each mode's difference from fp32 (or the first mode)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  window = max(1, min(25, len(results[0].losses) // 10))

  def mean(curve):  # moving mean over the applied (finite) steps, in bits; NaN where none
    ok = np.isfinite(curve)
    total = np.convolve(np.where(ok, curve, 0.0), np.ones(window), mode="valid")
    count = np.convolve(ok.astype(float), np.ones(window), mode="valid")
    return np.where(count > 0, total / np.maximum(count, 1), np.nan) / math.log(2)

  base = next((r for r in results if r.mode == "fp32"), results[0])
  steps = np.arange(len(results[0].losses) - window + 1) + window
  for r in results:
    label = f"{r.mode}: valid {r.valid_bpb:.3f} bits/byte, {r.skipped} skipped"
    curve = np.where(r.finite, r.losses, np.nan)
    line, = ax1.plot(steps, mean(curve), label=label)
    skipped = np.flatnonzero(~r.finite)
    if skipped.size:
      ax1.plot(skipped, np.full(skipped.size, 0.02), "|", color=line.get_color(), alpha=0.5,
               transform=ax1.get_xaxis_transform())
    if r is not base:
      ax2.plot(steps, mean(curve) - mean(base.losses), color=line.get_color(), label=r.mode)
  ax1.set_xlabel("step")
  ax1.set_ylabel(f"training loss, bits/byte ({window}-step mean of applied steps)")
  ax1.set_title(f"Byte-level Transformer LM, {loss} cross-entropy (|: skipped steps)")
  ax1.legend()
  ax2.axhline(0.0, color="black", lw=0.8)
  ax2.set_xlabel("step")
  ax2.set_ylabel(f"training loss minus {base.mode}'s, bits/byte")
  ax2.set_title(f"Difference from {base.mode}")
  ax2.legend()
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def sensitivity(model: TransformerLM, params: Any, valid: np.ndarray,
                args: argparse.Namespace) -> str:
  """``jmp.fp8_sensitivity`` of the loss of the first mode's trained model, on validation text."""
  starts = np.arange(args.batch) * (args.seq_len + 1)
  b = windows(valid, starts, args.seq_len)
  report = jmp.fp8_sensitivity(lambda p, b: loss_fn(model, p, b, False), params, b)
  return (f"FP8 sensitivity of the {args.modes[0]} model after {args.steps} steps, on "
          f"{args.batch} validation windows:\n\n```text\n{report}\n```\n\n"
          f"Keep rule for the worst 3: `{report.keep_rule(3)}`")


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = _common.parser(__doc__)
  p.add_argument("--steps", type=positive_int, default=1000,
                 help="training steps per mode (default: %(default)s; --smoke: 8)")
  p.add_argument("--batch", type=positive_int, default=32,
                 help="windows per step (default: %(default)s; --smoke: 4)")
  p.add_argument("--seq-len", type=positive_int, default=64,
                 help="bytes per window (default: %(default)s; --smoke: 16)")
  p.add_argument("--d-model", type=positive_int, default=64,
                 help="model width (default: %(default)s; --smoke: 16)")
  p.add_argument("--layers", type=positive_int, default=2,
                 help="Transformer blocks (default: %(default)s; --smoke: 1)")
  p.add_argument("--heads", type=positive_int, default=4,
                 help="attention heads; must divide --d-model (default: %(default)s; --smoke: 2)")
  p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: %(default)s)")
  p.add_argument("--corpus-mb", type=float, default=1.0,
                 help="MB of stdlib source to read (default: %(default)s; --smoke: 0.05)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the initial weights and the windows (default: %(default)s)")
  p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(DEFAULT_MODES),
                 help="the runs, in order; the first is the baseline of the table "
                      "(default: %(default)s)")
  p.add_argument("--loss", choices=("optax", "naive"), default="optax",
                 help="optax's cross-entropy, or the naive exp(logits) / sum(exp(logits)) "
                      "(results named transformer_lm_naive.*) (default: %(default)s)")
  p.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                 help="the learning rate after a 5%% warmup: a cosine decay to lr / 10, or wsd "
                      "(held, then cut linearly to 0 over the last 10%% of steps, with the "
                      f"validation bits/byte measured {DECAY_EVALS} times through the cut; "
                      "results named *_wsd.*) (default: %(default)s)")
  p.add_argument("--sensitivity", action="store_true",
                 help="after training the first mode, print and write jmp.fp8_sensitivity of its "
                      "model: which matmul FP8 hurts most (default: off)")
  _common.add_output_arguments(p, "a tiny model for a few steps, for CI")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and checks ``argv``; ``out`` becomes the folder to write to, or None."""
  p = build_parser()
  args = p.parse_args(argv)
  if args.d_model % args.heads:
    p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
  if args.smoke:
    args.steps, args.batch, args.seq_len, args.d_model, args.layers = 8, 4, 16, 16, 1
    args.heads, args.corpus_mb = 2, 0.05
  args.out = _common.output_dir(args.out, args.smoke)
  return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
  args = parse_args(argv)
  name = NAME if args.loss == "optax" else f"{NAME}_naive"
  if any(MODES[m][2] for m in args.modes):
    name += "_fp8"
  if any(m in LEAN_STATE for m in args.modes):
    name += "_lean_state"
  if args.schedule != "cosine":
    name += f"_{args.schedule}"
  train_tokens, valid_tokens = split(load_corpus(int(args.corpus_mb * 2**20)))
  model = TransformerLM(d_model=args.d_model, layers=args.layers, heads=args.heads,
                        max_len=args.seq_len)
  init_args = (jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))
  n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, *init_args)))
  print(f"stdlib source: {len(train_tokens):,} train / {len(valid_tokens):,} valid bytes; "
        f"Transformer {args.layers}x d_model {args.d_model}, {args.heads} heads, "
        f"{n_params:,} params; batch {args.batch} x {args.seq_len} bytes, {args.steps} steps "
        f"per mode; {args.loss} cross-entropy; modes {', '.join(args.modes)}; "
        f"{_common.machine()}", flush=True)
  _common.announce_output(args.out)
  params = jax.jit(model.init)(*init_args)
  results, trained = [], {}
  for mode in args.modes:
    policy_name, autocast, fp8 = MODES[mode]
    print(f"training {mode} (policy {policy_name}, autocast {autocast}"
          f"{', fp8' if fp8 else ''}) ...", flush=True)
    results.append(run(mode, model, params, train_tokens, valid_tokens, steps=args.steps,
                       batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                       naive=args.loss == "naive", progress=not args.no_progress,
                       trained=trained if not results else None, schedule=args.schedule))
  text = table(results)
  if args.sensitivity:
    text += "\n" + sensitivity(model, trained["params"], valid_tokens, args) + "\n"
  print()
  print(text)
  if args.out is None:
    print("smoke run: no files written (pass --out DIR to write them)")
    return results
  png = args.out / f"{name}.png"
  args.out.mkdir(parents=True, exist_ok=True)
  plot(results, png, args.loss)
  payload = {
      "config": _common.args_record(args),
      "train_bytes": len(train_tokens),
      "valid_bytes": len(valid_tokens),
      "params": n_params,
      "results": [
          {k: v for k, v in dataclasses.asdict(r).items() if not isinstance(v, np.ndarray)}
          for r in results
      ],
  }
  written = _common.write_results(args.out, name, text, payload)
  print("wrote " + ", ".join(str(p) for p in [png, *written]))
  return results


if __name__ == "__main__":
  main()
