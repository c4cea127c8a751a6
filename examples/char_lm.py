"""A byte-level 2-layer LSTM language model in fp32, bf16 and f16.

    python examples/char_lm.py                          # about 2 minutes on a 2-core CPU; writes out/
    python examples/char_lm.py --out examples/results   # regenerate the committed results
    python examples/char_lm.py --smoke                  # a few steps, for CI; writes nothing

After the PTB word-level LSTM experiments of the mixed-precision papers: a
2-layer LSTM trained with truncated backpropagation through time, the hidden
state carried from one batch to the next. The corpus is one every machine has
without downloading: the Python standard library's own ``*.py`` sources, read
in sorted file order; the first 90 % of the bytes train, the last 10 % validate.

The three runs share the data order and the initial weights; only the precision
changes (fp32: policy ``f32`` and plain ``optax.adam``; bf16: policy
``mixed_bfloat16`` and plain adam; f16: policy ``mixed_float16`` and
``jmp.dynamic_loss_scaling(adam)`` from 2**15). The LSTM state travels through
the train step as part of the batch (cast to the compute dtype by the step) and
comes back through ``has_aux``. The script prints validation perplexity per
byte, bits per byte, median step time, skipped steps and the final loss scale,
and writes ``char_lm.md`` and ``char_lm.json`` to ``--out`` (default ``out/`` at
the repository root, which git ignores).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp

import _common

MODES = ("fp32", "bf16", "f16")
POLICIES = {"fp32": "f32", "bf16": "mixed_bfloat16", "f16": "mixed_float16"}
MASTERS = _common.MASTERS  # --masters: lean master weights
VOCAB = 256  # bytes


def load_corpus(max_bytes: int) -> np.ndarray:
  """Up to ``max_bytes`` of the standard library's top-level ``*.py`` files, as uint8."""
  root = Path(os.path.dirname(os.__file__))
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  text = b"".join(chunks)[:max_bytes]
  if len(text) < 10_000:
    raise RuntimeError(f"found only {len(text)} bytes of Python source under {root}")
  return np.frombuffer(text, np.uint8).astype(np.int32)


def split(tokens: np.ndarray, valid_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  cut = int(len(tokens) * (1.0 - valid_fraction))
  return tokens[:cut], tokens[cut:]


def streams(tokens: np.ndarray, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Cuts ``tokens`` into ``batch`` parallel streams, then into ``seq_len`` chunks.

  Returns inputs and targets of shape (num_chunks, batch, seq_len): chunk ``i+1``
  of stream ``b`` continues chunk ``i`` of stream ``b``, so the LSTM state can be
  carried across chunks (PTB-style truncated BPTT).
  """
  per_stream = (len(tokens) - 1) // batch
  chunks = per_stream // seq_len
  if chunks < 1:
    raise ValueError(f"corpus of {len(tokens)} bytes too small for batch {batch} x seq {seq_len}")
  n = chunks * seq_len
  x = tokens[: batch * per_stream].reshape(batch, per_stream)[:, :n]
  y = tokens[1 : batch * per_stream + 1].reshape(batch, per_stream)[:, :n]
  to_chunks = lambda a: a.reshape(batch, chunks, seq_len).transpose(1, 0, 2)
  return to_chunks(x), to_chunks(y)


class LSTMLM(nn.Module):
  """Embedding, ``layers`` LSTMs of ``hidden`` units, a dense read-out (all ``dtype=None``)."""

  hidden: int = 128
  layers: int = 2
  embed: int = 64

  @nn.compact
  def __call__(self, tokens, carries):
    x = nn.Embed(VOCAB, self.embed)(tokens)
    new_carries = []
    for i in range(self.layers):
      carry, x = nn.RNN(nn.OptimizedLSTMCell(self.hidden), name=f"lstm_{i}")(
          x, initial_carry=carries[i], return_carry=True
      )
      new_carries.append(carry)
    return nn.Dense(VOCAB)(x), tuple(new_carries)

  def zero_carries(self, batch: int):
    z = jnp.zeros((batch, self.hidden), jnp.float32)
    return tuple((z, z) for _ in range(self.layers))


@dataclasses.dataclass
class Result:
  mode: str
  policy: str
  valid_ppl: float  # perplexity per byte on the validation text
  valid_bpb: float  # bits per byte
  train_loss: float  # mean of the last 50 steps, nats per byte
  step_ms: float
  skipped: int
  final_scale: float
  losses: np.ndarray
  masters: str = "f32"  # a key of MASTERS


def init_params(model: LSTMLM, tokens: np.ndarray, seed: int):
  """Initial weights for ``model`` on a (batch, seq_len) token array (jitted init)."""
  carries = model.zero_carries(tokens.shape[0])
  return jax.jit(model.init)(jax.random.key(seed), tokens, carries)


def cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def run(
    mode: str,
    train_chunks: tuple[np.ndarray, np.ndarray],
    valid_chunks: tuple[np.ndarray, np.ndarray],
    *,
    hidden: int = 128,
    layers: int = 2,
    steps: int = 1000,
    lr: float = 2e-3,
    clip: float = 1.0,
    seed: int = 0,
    init_scale: float = 2.0**15,
    growth_interval: int = 200,
    params=None,
    progress: bool = True,
    masters: str = "f32",
) -> Result:
  """Trains the LM for ``steps`` chunks in one precision ``mode``; returns its result.

  ``params`` (initial weights, e.g. from :func:`init_params`) default to a fresh
  initialisation from ``seed``; pass them to share one across modes.
  ``masters`` picks the master weights (a key of :data:`MASTERS`).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if masters not in MASTERS:
    raise ValueError(f"masters must be one of {tuple(MASTERS)}, got {masters!r}")
  policy = jmp.get_policy(POLICIES[mode])
  x_tr, y_tr = train_chunks
  batch = x_tr.shape[1]
  model = LSTMLM(hidden=hidden, layers=layers)

  def loss_fn(params, b):
    logits, carries = model.apply(params, b["x"], b["carries"])
    return cross_entropy(policy.cast_to_output(logits), b["y"]).mean(), carries

  @jax.jit
  def eval_chunk(params, carries, x, y):
    params = policy.cast_to_compute(params)
    logits, carries = model.apply(params, x, carries)
    return carries, cross_entropy(logits, y).sum()

  # Carries travel in the compute dtype, the dtype the step hands back in "aux":
  # one input signature, one compilation.
  zero_carries = lambda n: policy.cast_to_compute(model.zero_carries(n))
  if params is None:
    params = init_params(model, x_tr[0], seed)
  # A private copy: the train step donates (deletes) the state's buffers.
  params = jax.tree.map(jnp.copy, params)
  tx = optax.chain(optax.clip_by_global_norm(clip), optax.adam(lr))
  if mode == "f16":
    tx = jmp.dynamic_loss_scaling(tx, init_scale=init_scale, growth_interval=growth_interval)
  lean = dict(MASTERS[masters])
  if lean.get("rounding") == "stochastic":
    lean["key"] = jax.random.key(seed)
  state = jmp.TrainState.create(params=params, tx=tx, **lean)
  step = jmp.make_train_step(loss_fn, policy, has_aux=True)

  times, metrics = [], []
  desc = mode if masters == "f32" else f"{mode}/{masters}"
  bar = _common.progress(range(steps), desc=f"{desc:>4}", total=steps, enabled=progress)
  for i in bar:
    j = i % len(x_tr)
    if j == 0:  # a new pass over the training streams starts from a zero state
      carries = zero_carries(batch)
    b = {"x": x_tr[j], "y": y_tr[j], "carries": carries}
    (state, m), seconds = _common.timed_step(step, state, b)
    _common.show_skips(bar, m)
    carries = m["aux"]
    times.append(seconds)
    metrics.append({k: m[k] for k in ("loss", "grads_finite")})
  metrics = jax.device_get(metrics)
  losses = np.array([m["loss"] for m in metrics], np.float32)
  skipped = int(sum(not m["grads_finite"] for m in metrics))

  carries, nll, count = zero_carries(valid_chunks[0].shape[1]), 0.0, 0
  for x, y in zip(*valid_chunks):
    carries, chunk_nll = eval_chunk(state.params, carries, x, y)
    nll += float(chunk_nll)
    count += y.size
  nats = nll / count
  return Result(
      mode=mode,
      policy=str(policy),
      valid_ppl=math.exp(nats),
      valid_bpb=nats / math.log(2),
      train_loss=float(losses[-50:].mean()),
      step_ms=_common.median_ms(times, warmup=min(5, len(times) - 1)),
      skipped=skipped,
      final_scale=float(jmp.loss_scale_of(state.opt_state)),
      losses=losses,
      masters=masters,
  )


def table(results: Sequence[Result]) -> str:
  base = next((r for r in results if r.mode == "fp32"), results[0])
  lean = any(r.masters != "f32" for r in results)  # a masters column only when it varies
  rows = [
      [
          r.mode,
          *([r.masters] if lean else []),
          r.policy,
          f"{r.valid_ppl:.3f}",
          f"{r.valid_bpb:.3f}",
          f"{r.train_loss:.3f}",
          f"{r.step_ms:.1f}",
          f"{r.step_ms / base.step_ms:.2f}x",
          r.skipped,
          f"{r.final_scale:.10g}",
      ]
      for r in results
  ]
  headers = ["mode", *(["masters"] if lean else []), "policy", "valid ppl/byte",
             "valid bits/byte", "train loss (last 50)", "step ms (median)", "vs fp32",
             "skipped steps", "final scale"]
  return _common.markdown_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = _common.parser(__doc__)
  p.add_argument("--steps", type=int, default=1000,
                 help="training steps (chunks) per mode (default: %(default)s; --smoke: 6)")
  p.add_argument("--batch", type=int, default=32,
                 help="parallel streams B (default: %(default)s; --smoke: 8)")
  p.add_argument("--seq-len", type=int, default=32,
                 help="truncated BPTT length (default: %(default)s; --smoke: 16)")
  p.add_argument("--hidden", type=int, default=128,
                 help="LSTM units N per layer (default: %(default)s; --smoke: 32)")
  p.add_argument("--layers", type=int, default=2,
                 help="LSTM layers (default: %(default)s; --smoke: 1)")
  p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default: %(default)s)")
  p.add_argument("--corpus-mb", type=float, default=1.0,
                 help="MB of stdlib source to read (default: %(default)s; --smoke: 0.05)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the initial weights (default: %(default)s)")
  _common.add_scale_arguments(p)
  _common.add_masters_argument(p, "char_lm_masters")
  _common.add_output_arguments(p, "a tiny model for a few steps, for CI")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and checks ``argv``; ``out`` becomes the folder to write to, or None."""
  p = build_parser()
  args = p.parse_args(argv)
  args.masters = _common.masters_list(p, args.masters)
  for name in ("steps", "batch", "seq_len", "hidden", "layers"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.smoke:
    args.steps, args.hidden, args.layers, args.batch, args.seq_len = 6, 32, 1, 8, 16
    args.corpus_mb = 0.05
  args.out = _common.output_dir(args.out, args.smoke)
  return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
  args = parse_args(argv)
  tokens = load_corpus(int(args.corpus_mb * 2**20))
  train_tokens, valid_tokens = split(tokens)
  train_chunks = streams(train_tokens, args.batch, args.seq_len)
  valid_chunks = streams(valid_tokens, args.batch, args.seq_len)
  runs = [(mode, "f32") for mode in MODES] + [("bf16", m) for m in args.masters]
  passes = args.steps / len(train_chunks[0])
  print(f"stdlib source: {len(train_tokens):,} train / {len(valid_tokens):,} valid bytes; "
        f"{args.layers}x LSTM({args.hidden}), B={args.batch}, T={args.seq_len}, "
        f"{args.steps} steps ({passes:.2f} passes over the train text) per run; runs "
        f"{', '.join(m if w == 'f32' else f'{m}/{w}' for m, w in runs)}; {_common.machine()}",
        flush=True)
  _common.announce_output(args.out)
  model = LSTMLM(hidden=args.hidden, layers=args.layers)
  params = init_params(model, train_chunks[0][0], args.seed)  # shared by the three modes
  results = [
      run(mode, train_chunks, valid_chunks, hidden=args.hidden, layers=args.layers,
          steps=args.steps, lr=args.lr, seed=args.seed, init_scale=args.init_scale,
          growth_interval=args.growth_interval, params=params, progress=not args.no_progress,
          masters=masters)
      for mode, masters in runs
  ]
  text = table(results)
  print()
  print(text)
  for r in results:
    if r.masters != "f32":
      gap = r.valid_bpb / results[0].valid_bpb - 1.0
      print(f"  {r.masters} masters: validation bits/byte {100 * gap:+.2f}% vs fp32 "
            f"({'within' if abs(gap) <= 0.01 else 'NOT within'} 1%)")

  out = args.out
  if out is None:
    print("smoke run: no files written (pass --out DIR to write them)")
    return results
  payload = {
      "config": _common.args_record(args),
      "train_bytes": len(train_tokens),
      "valid_bytes": len(valid_tokens),
      "results": [
          {k: v for k, v in dataclasses.asdict(r).items() if not isinstance(v, np.ndarray)}
          for r in results
      ],
  }
  written = _common.write_results(out, "char_lm_masters" if args.masters else "char_lm", text,
                                  payload)
  print("wrote " + ", ".join(str(p) for p in written))
  return results


if __name__ == "__main__":
  main()
