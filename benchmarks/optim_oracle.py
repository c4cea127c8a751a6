"""8-bit Adam state against torchao's on the same problem: parameter drift and the mixed-magnitude probe.

Run ``python -m benchmarks.optim_oracle --help``. It needs torch and torchao
(``pip install torch torchao``, or ``pip install -e '.[oracle]'``), which the
tests and the other benchmarks never do; without them it stops with that
message. torchao's optimizers call ``torch.compile`` in each step; the
benchmark replaces it by the identity while they step, so they run eagerly on
the CPU (their arithmetic is the same, only not fused).

Two measurements, each optimizer fed the gradients of its own parameters
(computed in NumPy, float32, by the same code for all):

- **drift**: a tanh MLP (64-128-64, both kernels >= 4096 elements, so torchao
  codes them too; the biases stay float32 on both sides) trained for
  ``--steps`` AdamW steps from the same weights on the same batches. The
  drift of an 8-bit optimizer is its parameters' distance from the same
  side's float32 AdamW (``optax.adamw`` for ours, ``torch.optim.AdamW`` for
  torchao's), over the distance float32 AdamW moved them.
- **blow-up**: Adam (no weight decay) on a (16, 256) parameter whose columns
  see gradients of 1 or 1e-6 (times uniform noise in [0.5, 1.5]) for
  ``--probe-steps`` steps. The largest update of an 8-bit optimizer over its
  side's float32 Adam's largest.

Bars: our int8 drift <= torchao ``AdamW8bit``'s, our float8 drift <=
``AdamWFp8``'s; our largest step on the probe <= 1.5x float32 Adam's.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
from typing import Any, Callable, Iterator

import numpy as np

from benchmarks import bars as bars_lib
from benchmarks import cli
from benchmarks import report

PROG = "python -m benchmarks.optim_oracle"
INSTALL = "pip install torch torchao"
# name: (side, what it is); the side's float32 reference is the first of its side.
OPTIMIZERS = {
    "optax_adamw": ("jax", "optax.adamw, float32 state"),
    "jmp_int8": ("jax", "jmp.quantize_state(optax.adamw, 'int8')"),
    "jmp_float8": ("jax", "jmp.quantize_state(optax.adamw, 'float8')"),
    "torch_adamw": ("torch", "torch.optim.AdamW, float32 state"),
    "torchao_adamw8bit": ("torch", "torchao.optim.AdamW8bit"),
    "torchao_adamwfp8": ("torch", "torchao.optim.AdamWFp8"),
}
REFERENCE = {"jax": "optax_adamw", "torch": "torch_adamw"}
RIVAL = {"jmp_int8": "torchao_adamw8bit", "jmp_float8": "torchao_adamwfp8"}
BLOW_UP_LIMIT = 1.5
SIZES = (64, 128, 64)  # in, hidden, out
WEIGHT_DECAY = 1e-2


def import_torch() -> tuple[Any, Any]:
  """``(torch, torchao.optim)``, or a ``SystemExit`` that says how to install them."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import torchao.optim  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise SystemExit(f"{PROG} compares against torchao and needs torch and torchao, which are "
                     f"not installed ({e}). Install them with `{INSTALL}` (or `pip install -e "
                     f"'.[oracle]'`), in a separate environment if you like.") from e
  return torch, torchao.optim


@contextlib.contextmanager
def eager_torch_compile(torch: Any) -> Iterator[None]:
  """``torch.compile`` as the identity while torchao steps: it runs eagerly on the CPU."""
  original = torch.compile
  torch.compile = lambda fn=None, **kwargs: fn
  try:
    yield
  finally:
    torch.compile = original


# ------------------------------------------------------------------ the problem


def mlp_init(seed: int) -> dict[str, np.ndarray]:
  """The MLP's float32 initial weights."""
  n_in, hidden, n_out = SIZES
  rng = np.random.default_rng(seed)
  return {"w1": (rng.standard_normal((n_in, hidden)) / np.sqrt(n_in)).astype(np.float32),
          "b1": np.zeros(hidden, np.float32),
          "w2": (rng.standard_normal((hidden, n_out)) / np.sqrt(hidden)).astype(np.float32),
          "b2": np.zeros(n_out, np.float32)}


def mlp_batch(seed: int, step: int, n: int = 128) -> tuple[np.ndarray, np.ndarray]:
  """Step ``step``'s batch: ``x`` normal, ``y = sin(x @ t)`` for a fixed random ``t``."""
  n_in, _, n_out = SIZES
  teacher = np.random.default_rng(seed + 1).standard_normal((n_in, n_out)).astype(np.float32)
  x = np.random.default_rng([seed, step]).standard_normal((n, n_in)).astype(np.float32)
  return x, np.sin(x @ teacher / np.sqrt(n_in) * 2).astype(np.float32)


def mlp_loss_and_grads(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
                       ) -> tuple[float, dict[str, np.ndarray]]:
  """Mean squared error of ``tanh(x w1 + b1) w2 + b2`` and its gradients, float32."""
  h = np.tanh(x @ p["w1"] + p["b1"])
  err = h @ p["w2"] + p["b2"] - y
  d_out = (2.0 / err.size) * err
  d_pre = (d_out @ p["w2"].T) * (1.0 - h * h)
  grads = {"w1": x.T @ d_pre, "b1": d_pre.sum(0), "w2": h.T @ d_out, "b2": d_out.sum(0)}
  return float(np.mean(err * err)), {k: g.astype(np.float32) for k, g in grads.items()}


GradFn = Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]


# ------------------------------------------------------------------ the runners


def run_jax(name: str, params: dict[str, np.ndarray], grad_fn: GradFn, steps: int, lr: float,
            weight_decay: float, record: Callable[[np.ndarray], None] | None = None
            ) -> dict[str, np.ndarray]:
  """Steps ``name``'s optax transformation; ``record`` sees each update of ``params["w"]``."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import jmp_lite as jmp  # pylint: disable=import-outside-toplevel

  tx = optax.adamw(lr, weight_decay=weight_decay)
  if name != "optax_adamw":
    tx = jmp.quantize_state(tx, name.removeprefix("jmp_"))

  @jax.jit
  def update(grads: Any, state: Any, p: Any) -> Any:
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), updates, state

  p = jax.tree.map(jax.numpy.asarray, params)
  state = tx.init(p)
  for t in range(steps):
    p, updates, state = update(grad_fn(t, jax.device_get(p)), state, p)
    if record is not None:
      record(np.asarray(updates["w"]))
  return {k: np.asarray(v) for k, v in p.items()}


def run_torch(name: str, params: dict[str, np.ndarray], grad_fn: GradFn, steps: int, lr: float,
              weight_decay: float, record: Callable[[np.ndarray], None] | None = None
              ) -> dict[str, np.ndarray]:
  """Steps ``name``'s torch optimizer; ``record`` sees each update of ``params["w"]``."""
  torch, ao = import_torch()
  make = {"torch_adamw": torch.optim.AdamW, "torchao_adamw8bit": ao.AdamW8bit,
          "torchao_adamwfp8": ao.AdamWFp8}[name]
  p = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
  opt = make(list(p.values()), lr=lr, weight_decay=weight_decay)
  with eager_torch_compile(torch):
    for t in range(steps):
      before = p["w"].detach().clone() if record is not None else None
      grads = grad_fn(t, {k: v.detach().numpy().copy() for k, v in p.items()})
      for k, v in p.items():
        v.grad = torch.from_numpy(grads[k])
      opt.step()
      if before is not None and record is not None:
        record((p["w"].detach() - before).numpy())
  return {k: v.detach().numpy().copy() for k, v in p.items()}


def run(name: str, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
  """Runs ``name`` on its side (JAX or torch)."""
  runner = run_jax if OPTIMIZERS[name][0] == "jax" else run_torch
  return runner(name, *args, **kwargs)


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
  """The Euclidean distance between two parameter dicts, in float64."""
  return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


def drift(names: list[str], steps: int, lr: float, seed: int) -> dict[str, dict[str, float]]:
  """Each optimizer's final loss and its drift from its side's float32 AdamW on the MLP."""
  params0 = mlp_init(seed)

  def grad_fn(t: int, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return mlp_loss_and_grads(p, *mlp_batch(seed, t))[1]

  final = {n: run(n, params0, grad_fn, steps, lr, WEIGHT_DECAY) for n in names}
  out = {}
  for n in names:
    ref = final[REFERENCE[OPTIMIZERS[n][0]]]
    out[n] = dict(loss=mlp_loss_and_grads(final[n], *mlp_batch(seed, 10**6))[0],
                  drift=distance(final[n], ref) / distance(ref, params0))
  if {"optax_adamw", "torch_adamw"} <= set(names):  # the two sides solve the same problem
    out["torch_adamw"]["vs_optax_adamw"] = (distance(final["torch_adamw"], final["optax_adamw"])
                                            / distance(final["optax_adamw"], params0))
  return out


def drift_over_seeds(names: list[str], steps: int, lr: float, seeds: list[int]
                     ) -> tuple[dict[str, dict[str, float]], list[dict[str, dict[str, float]]]]:
  """:func:`drift` for each seed: the mean drift and loss (and the largest drift), and each seed's."""
  each = [drift(names, steps, lr, s) for s in seeds]
  mean = {n: dict(drift=float(np.mean([e[n]["drift"] for e in each])),
                  drift_max=max(e[n]["drift"] for e in each),
                  loss=float(np.mean([e[n]["loss"] for e in each]))) for n in names}
  if "vs_optax_adamw" in each[0].get("torch_adamw", {}):
    mean["torch_adamw"]["vs_optax_adamw"] = max(e["torch_adamw"]["vs_optax_adamw"] for e in each)
  return mean, each


def blow_up(names: list[str], steps: int, lr: float, seed: int) -> dict[str, dict[str, float]]:
  """Each optimizer's largest update on the mixed-magnitude probe, and over its side's fp32 Adam."""
  magnitude = np.where(np.arange(256) % 2 == 0, 1.0, 1e-6).astype(np.float32)

  def grad_fn(t: int, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    noise = np.random.default_rng([seed, t]).uniform(0.5, 1.5, (16, 256)).astype(np.float32)
    return {"w": magnitude * noise}

  largest = {}
  for n in names:
    seen = [0.0]
    run(n, {"w": np.zeros((16, 256), np.float32)}, grad_fn, steps, lr, 0.0,
        record=lambda u, seen=seen: seen.__setitem__(0, max(seen[0], float(np.max(np.abs(u))))))
    largest[n] = seen[0]
  return {n: dict(largest=v, over_lr=v / lr,
                  vs_fp32=v / largest[REFERENCE[OPTIMIZERS[n][0]]]) for n, v in largest.items()}


# ------------------------------------------------------------------ the report


def check_bars(result: dict[str, Any], meaningful: bool) -> list[dict[str, Any]]:
  """Ours against torchao's drift, and our probe's largest step against fp32 Adam's."""
  found = []
  for ours, theirs in RIVAL.items():
    d = result["drift"]
    found.append(bars_lib.bar("optim_oracle", f"{ours} drift / {theirs} drift (mean over seeds)",
                              d[ours]["drift"] / d[theirs]["drift"], 1.0, meaningful,
                              model="mlp"))
    found.append(bars_lib.bar("optim_oracle", f"{ours}: largest step / fp32 Adam's",
                              result["blow_up"][ours]["vs_fp32"], BLOW_UP_LIMIT, meaningful,
                              model="probe"))
  return found


def markdown(result: dict[str, Any]) -> str:
  """The report: one row per optimizer, then the bars."""
  c = dict(result["meta"]["args"], steps=result["steps"], probe_steps=result["probe_steps"])
  lines = [report.meta_line(result["meta"]), "",
           f"Drift: a {'-'.join(map(str, SIZES))} tanh MLP, {c['steps']} AdamW steps at lr "
           f"{c['lr']}, weight decay {WEIGHT_DECAY}, {len(result['drift_by_seed'])} seeds (weights, "
           "batches; the mean, and the largest in brackets); the distance of the final parameters from "
           "the same side's float32 AdamW over the distance float32 AdamW moved them. Blow-up: "
           f"Adam at lr {c['probe_lr']} on (16, 256) params whose columns see gradients of 1 or "
           f"1e-6, {c['probe_steps']} steps; the largest update over the same side's float32 "
           "Adam's. torchao ran eagerly (`torch.compile` replaced by the identity).", "",
           "| optimizer | what | drift from fp32 AdamW | final loss | largest probe step / lr | "
           "vs fp32 Adam's largest |", "|---|---|---|---|---|---|"]
  for name, (_, what) in OPTIMIZERS.items():
    d, b = result["drift"].get(name), result["blow_up"].get(name)
    if d is None or b is None:
      continue
    lines.append(f"| {name} | {what} | {100 * d['drift']:.2f}% ({100 * d['drift_max']:.2f}%) | "
                 f"{d['loss']:.5f} | "
                 f"{b['over_lr']:.3f} | {b['vs_fp32']:.2f}x |")
  for ours, theirs in RIVAL.items():
    ratios = [e[ours]["drift"] / e[theirs]["drift"] for e in result["drift_by_seed"]]
    lines += ["", f"{ours} drift / {theirs} drift, seed by seed: "
                  + ", ".join(f"{r:.2f}" for r in ratios)]
  cross = result["drift"].get("torch_adamw", {}).get("vs_optax_adamw")
  if cross is not None:
    lines += ["", f"torch.optim.AdamW ends at most {100 * cross:.4f}% (of the distance moved) from "
                  "optax.adamw: the two sides solve the same problem."]
  lines += ["", *report.bars_table(result["bars"])]
  return "\n".join(lines) + "\n"


def build_parser() -> Any:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, "Optimizers: " + ", ".join(OPTIMIZERS)
                 + f". Needs torch and torchao: {INSTALL}.")
  p.add_argument("--steps", type=cli.positive_int, default=500,
                 help="AdamW steps on the MLP (default: %(default)s)")
  p.add_argument("--lr", type=cli.positive_float, default=3e-3,
                 help="AdamW learning rate on the MLP (default: %(default)s)")
  p.add_argument("--probe-steps", type=cli.positive_int, default=3000,
                 help="Adam steps on the mixed-magnitude probe (default: %(default)s)")
  p.add_argument("--probe-lr", type=cli.positive_float, default=1e-3,
                 help="Adam learning rate on the probe (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="first seed of the weights and batches, and the probe's noise "
                      "(default: %(default)s)")
  p.add_argument("--seeds", type=cli.positive_int, default=4,
                 help="MLP runs from seeds --seed, --seed + 1, ... (default: %(default)s)")
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true", help="20 steps each, one seed: a quick check")
  p.add_argument("--strict", action="store_true", help="exit with status 1 if a bar fails")
  return p


def main(argv: list[str] | None = None) -> int:
  """Measures and writes ``optim-oracle-<machine>-<date>.{json,md}``."""
  argv = sys.argv[1:] if argv is None else argv
  args = build_parser().parse_args(argv)
  torch, _ = import_torch()
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", "cpu")
  steps, probe_steps = (20, 20) if args.smoke else (args.steps, args.probe_steps)
  names = list(OPTIMIZERS)
  seeds = [args.seed + i for i in range(1 if args.smoke else args.seeds)]
  mean, each = drift_over_seeds(names, steps, args.lr, seeds)
  result: dict[str, Any] = dict(
      steps=steps, probe_steps=probe_steps, drift=mean, drift_by_seed=each,
      blow_up=blow_up(names, probe_steps, args.probe_lr, args.seed))
  result["bars"] = check_bars(result, meaningful=not args.smoke)
  meta = report.meta(cli.command(PROG, argv), jax.devices("cpu")[0], args=cli.args_record(args),
                     smoke=args.smoke, torch=str(torch.__version__),
                     torchao=str(__import__("torchao").__version__))
  result = dict(meta=meta, **result)
  stem = (report.output_dir(args.out, args.smoke)
          / f"optim-oracle-{report.machine_name(jax.devices('cpu')[0])}-{meta['date']}")
  report.publish(result, stem, markdown(result))
  return report.bars_status(result["bars"], args.strict)


if __name__ == "__main__":
  sys.exit(main())
