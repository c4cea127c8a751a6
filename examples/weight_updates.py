"""Updates smaller than half an ulp: float32 masters vs bf16 masters (nearest, stochastic, Kahan).

    python examples/weight_updates.py                          # about 30 s on a 2-core CPU; writes out/
    python examples/weight_updates.py --out examples/results   # regenerate the committed results
    python examples/weight_updates.py --smoke                  # a few steps, for CI; writes nothing

The seed of mixed precision: "Update may be too small compared to the weight
(if > 2048 times), then float16 addition causes update to become 0. Solution:
maintain master copy of weights in float32". bfloat16 has 8 significant bits,
so the threshold is 256: a weight near 1 ignores any update below 2**-9.

A student MLP (32 -> 64 -> 8, tanh) starts from a teacher's weights plus
noise of size 0.03 and is fine-tuned with Adam at a learning rate of 1e-4,
so that every step moves a weight by about 1e-4: 20 to 40 times less than
half an ulp of a bf16 weight of magnitude 1 to 2. The four runs share the
data and initial weights; only the master weights change:

* ``fp32``: ``TrainState.create(params, tx)``, float32 masters (4 bytes).
* ``bf16-nearest``: bfloat16 masters rounded to nearest (2 bytes): the
  updates of every weight above ~0.05 in magnitude are rounded away.
* ``bf16-stochastic``: bfloat16 masters with stochastic rounding (2 bytes).
* ``bf16-kahan``: bfloat16 masters plus a bfloat16 compensation (4 bytes).

The script prints a table and writes ``weight_updates.{md,json,png}`` to
``--out`` (default ``out/`` at the repository root, which git ignores).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp

import _common

MODES = {
    "fp32": dict(),
    "bf16-nearest": dict(master_dtype=jnp.bfloat16, rounding="nearest"),
    "bf16-stochastic": dict(master_dtype=jnp.bfloat16, rounding="stochastic"),
    "bf16-kahan": dict(master_dtype=jnp.bfloat16, rounding="kahan"),
}
SIZES = (32, 64, 8)
SIZE_KEYS = ("w1", "b1", "w2", "b2")


def mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def teacher_and_student(seed: int, noise: float):
  """The teacher's weights (|w| mostly 0.3-2) and the student's start: teacher + noise."""
  k1, k2, k3, k4, kn = jax.random.split(jax.random.key(seed), 5)
  d, h, o = SIZES
  teacher = {
      "w1": jax.random.normal(k1, (d, h)) * 1.0,
      "b1": jax.random.normal(k2, (h,)) * 0.5,
      "w2": jax.random.normal(k3, (h, o)) * 1.0,
      "b2": jax.random.normal(k4, (o,)) * 0.5,
  }
  keys = dict(zip(teacher, jax.random.split(kn, len(teacher))))
  student = {k: v + noise * jax.random.normal(keys[k], v.shape) for k, v in teacher.items()}
  return teacher, student


def make_batches(teacher, seed: int, count: int, batch: int):
  xs = jax.random.normal(jax.random.key(seed + 1), (count, batch, SIZES[0]))
  return [{"x": x, "y": mlp(teacher, x)} for x in xs]


def half_ulp_bf16(w: np.ndarray) -> np.ndarray:
  """Half the gap below |w| in bfloat16: an update smaller than this is rounded away."""
  w = np.abs(np.asarray(w, np.float64))
  return 2.0 ** (np.floor(np.log2(np.maximum(w, 2.0**-126))) - 9)


@dataclasses.dataclass
class Result:
  mode: str
  master_bytes: int  # bytes per weight: params plus compensation
  first_loss: float
  final_loss: float  # mean of the last 50 steps
  moved: float  # percent of weights that differ from their initial value
  left_to_fp32: float  # |w - w_fp32| / |w_start - w_fp32|, percent: how far from the fp32 run
  step_ms: float
  losses: np.ndarray
  trajectory: np.ndarray  # the watched weight after every step


def run(mode: str, student, batches, *, steps: int, lr: float, policy: str, watch, seed: int,
        progress: bool = True) -> tuple[Result, dict]:
  """Fine-tunes the student for ``steps`` with one kind of masters; returns the result and final weights."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
  kwargs = dict(MODES[mode])
  if kwargs.get("rounding") == "stochastic":
    kwargs["key"] = jax.random.key(seed)
  state = jmp.TrainState.create(params=student, tx=optax.adam(lr), **kwargs)
  init = jax.tree.map(np.asarray, state.params)

  def loss_fn(params, batch):
    return jnp.mean((mlp(params, batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)

  step = jmp.make_train_step(loss_fn, jmp.get_policy(policy))
  name, index = watch
  losses, times, trajectory = [], [], []
  for i in _common.progress(range(steps), desc=f"{mode:>15}", total=steps, enabled=progress):
    (state, metrics), seconds = _common.timed_step(step, state, batches[i % len(batches)])
    times.append(seconds)
    losses.append(metrics["loss"])
    trajectory.append(state.params[name][index])
  losses = np.asarray(jax.device_get(losses), np.float32)
  final = jax.tree.map(lambda x: np.asarray(x, np.float32), state.params)
  moved = sum(int(np.sum(final[k] != np.asarray(init[k], np.float32))) for k in final)
  total = sum(v.size for v in final.values())
  per_weight = 2 if "master_dtype" in kwargs else 4
  result = Result(
      mode=mode,
      master_bytes=per_weight * (2 if kwargs.get("rounding") == "kahan" else 1),
      first_loss=float(losses[0]),
      final_loss=float(losses[-50:].mean()),
      moved=100.0 * moved / total,
      left_to_fp32=float("nan"),
      step_ms=_common.median_ms(times, warmup=min(5, len(times) - 1)),
      losses=losses,
      trajectory=np.asarray(jax.device_get(trajectory), np.float32),
  )
  return result, final


def table(results: Sequence[Result]) -> str:
  rows = [
      [
          r.mode,
          r.master_bytes,
          f"{r.first_loss:.3e}",
          f"{r.final_loss:.3e}",
          f"{r.first_loss / r.final_loss:.1f}x",
          f"{r.moved:.1f}%",
          f"{r.left_to_fp32:.1f}%",
          f"{r.step_ms:.2f}",
      ]
      for r in results
  ]
  headers = ["masters", "bytes/weight", "first loss", "final loss (last 50)", "loss reduction",
             "weights moved", "distance left to fp32 weights", "step ms"]
  return _common.markdown_table(headers, rows)


def plot(results: Sequence[Result], path: Path, watch, steps: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
  window = max(1, min(50, steps // 10))
  kernel = np.ones(window) / window
  styles = {"fp32": "k-", "bf16-nearest": "C3-", "bf16-stochastic": "C0-", "bf16-kahan": "C2--"}
  for r in results:
    smooth = np.convolve(r.losses, kernel, mode="valid")
    ax1.plot(np.arange(len(smooth)) + window, smooth, styles[r.mode], label=r.mode, lw=1.2)
    ax2.plot(np.arange(1, len(r.trajectory) + 1), r.trajectory, styles[r.mode], label=r.mode,
             lw=1.0, drawstyle="steps-post")
  ax1.set(yscale="log", xlabel="step", ylabel=f"train loss (mean of {window} steps)",
          title="Fine-tuning with updates < half a bf16 ulp")
  ax1.legend()
  name, index = watch
  ax2.set(xlabel="step", ylabel="weight value (as stored)",
          title=f"One weight, {name}{list(index)}: bf16 ulp steps vs float32")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = _common.parser(__doc__)
  p.add_argument("--steps", type=int, default=2000,
                 help="Adam steps per run (default: %(default)s; --smoke: 30)")
  p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default: %(default)s)")
  p.add_argument("--noise", type=float, default=0.03,
                 help="student = teacher + noise * N(0, 1) (default: %(default)s)")
  p.add_argument("--batch", type=int, default=256, help="examples per step (default: %(default)s)")
  p.add_argument("--policy", default="mixed_bfloat16",
                 help="compute policy, a jmp.get_policy name (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the teacher, the noise and the data (default: %(default)s)")
  _common.add_output_arguments(p, "30 steps per run, for CI")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and checks ``argv``; ``out`` becomes the folder to write to, or None."""
  p = build_parser()
  args = p.parse_args(argv)
  for name in ("steps", "batch"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if not args.lr > 0:
    p.error(f"--lr must be > 0, got {args.lr}")
  if args.smoke:
    args.steps = 30
  args.out = _common.output_dir(args.out, args.smoke)
  return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
  args = parse_args(argv)
  teacher, student = teacher_and_student(args.seed, args.noise)
  batches = make_batches(teacher, args.seed, count=64, batch=args.batch)
  # Watch the weight that has the farthest to go among the large ones.
  w1, t1 = np.asarray(student["w1"]), np.asarray(teacher["w1"])
  gap = np.where(np.abs(w1) > 1.0, np.abs(t1 - w1), 0.0)
  watch = ("w1", tuple(int(i) for i in np.unravel_index(np.argmax(gap), gap.shape)))
  n = sum(v.size for v in student.values())
  print(f"teacher-student MLP, {n} weights, 64 batches of {args.batch}; {args.steps} Adam steps "
        f"at lr {args.lr:g} per run, policy {args.policy}; runs {', '.join(MODES)}; "
        f"{_common.machine()}", flush=True)
  _common.announce_output(args.out)
  results, finals = [], {}
  for mode in MODES:
    print(f"training with {mode} masters ...", flush=True)
    result, final = run(mode, student, batches, steps=args.steps, lr=args.lr, policy=args.policy,
                        watch=watch, seed=args.seed, progress=not args.no_progress)
    results.append(result)
    finals[mode] = final
  # Distance to the fp32 run's final weights, as a fraction of where it started.
  flat = lambda tree: np.concatenate([np.asarray(tree[k], np.float64).ravel() for k in SIZE_KEYS])
  ref = flat(finals["fp32"])
  start_gap = np.linalg.norm(flat(student) - ref)
  for r in results:
    r.left_to_fp32 = float(100.0 * np.linalg.norm(flat(finals[r.mode]) - ref) / start_gap)
  # The floor for any bf16 storage: the fp32 result itself rounded to bf16.
  floor = float(100.0 * np.linalg.norm(
      np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float64) - ref) / start_gap)
  # How small the updates are: Adam moves a weight by about lr per step (exactly
  # lr on the first step), against half an ulp of the weight in bf16.
  ratio = args.lr / half_ulp_bf16(flat(student))
  text = table(results)
  print(f"\nlr / half a bf16 ulp of the weight: median {np.median(ratio):.3f}, "
        f"{100 * np.mean(ratio < 1):.1f}% of weights below 1 (their updates round away)\n")
  print(text)
  note = (f"The fp32 run's own weights rounded to bf16 are {floor:.1f}% away from it: "
          "the floor for any bf16 storage.")
  print(f"\n{note}")
  out = args.out
  if out is None:
    print("smoke run: no files written (pass --out DIR to write them)")
    return results
  out.mkdir(parents=True, exist_ok=True)
  png = out / "weight_updates.png"
  plot(results, png, watch, args.steps)
  payload = {
      "config": _common.args_record(args),
      "weights": int(n),
      "watched_weight": [watch[0], list(watch[1])],
      "lr_over_half_ulp": {"median": float(np.median(ratio)),
                           "fraction_below_1": float(np.mean(ratio < 1))},
      "results": [
          {k: v for k, v in dataclasses.asdict(r).items() if not isinstance(v, np.ndarray)}
          for r in results
      ],
  }
  payload["bf16_rounding_floor_percent"] = floor
  written = _common.write_results(out, "weight_updates", f"{text}\n\n{note}", payload)
  print("wrote " + ", ".join(str(p) for p in [png, *written]))
  return results


if __name__ == "__main__":
  main()
