"""Activation memory: the bytes the backward pass keeps, under float32, the bf16 policy and autocast.

    python -m benchmarks.residuals                            # about a minute on a 2-core CPU; writes out/
    python -m benchmarks.residuals --out benchmarks/results   # regenerate the committed results
    python -m benchmarks.residuals --smoke                    # tiny sizes, for CI; writes to a temp folder

The measure, *residual bytes*: the sum of the bytes of the arrays that
``jax.vjp`` of the loss keeps for the backward pass (the leaves of the
pullback it returns), with the loss run as ``make_train_step`` runs it: the
float32 params are the differentiated input and are cast by the policy inside
the differentiated function, the batch is cast by the policy, and with
``autocast=True`` the loss is wrapped in ``jmp.autocast(loss, compute_dtype)``.
Only shapes and dtypes are read (``jax.eval_shape``): nothing runs, and the
number does not depend on the backend (it is what a step keeps alive from the
forward pass to the backward pass before the compiler reorders or frees
anything; the compiled program's temp memory is another measure).

Variants:

  fp32            policy ``f32``
  bf16            policy ``mixed_bfloat16``: params and batch cast to bfloat16
  bf16_autocast   the same with ``autocast=True``
  f16_autocast    policy ``mixed_float16`` with ``autocast=True``

Models: the benchmark Transformer, CNN and LSTM of ``benchmarks.models``
(preset ``cpu``) and ``vit``, a ViT built from stock Linen layers
(``nn.Conv`` patches, ``nn.LayerNorm``, ``nn.MultiHeadDotProductAttention``,
``nn.Dense``, ``nn.gelu``) on 32x32 images. The bar (issue 29): bf16
autocast keeps at most 0.6 of float32's bytes on the Transformer, the CNN and
the ViT.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jmp
from benchmarks import cli
from benchmarks import models
from benchmarks import report

PROG = "python -m benchmarks.residuals"
VARIANTS = ("fp32", "bf16", "bf16_autocast", "f16_autocast")
POLICIES = {"fp32": ("f32", False), "bf16": ("mixed_bfloat16", False),
            "bf16_autocast": ("mixed_bfloat16", True), "f16_autocast": ("mixed_float16", True)}
MODELS = ("transformer", "cnn", "vit", "lstm")
BAR = 0.6  # bf16_autocast / fp32 on the models in BAR_MODELS
BAR_MODELS = ("transformer", "cnn", "vit")
VIT_PRESETS = {
    "smoke": dict(batch=2, image=8, patch=4, hidden=16, heads=2, layers=1, classes=10),
    "cpu": dict(batch=32, image=32, patch=4, hidden=192, heads=3, layers=2, classes=10),
}


def build_vit(preset: str, seed: int = 0) -> models.Problem:
  """The ViT problem: random images (never zeros), integer labels, softmax cross-entropy.

  Examples:
    >>> p = build_vit("smoke")
    >>> p.batch["x"].shape, jax.eval_shape(p.loss_fn, p.params, p.batch).shape
    ((2, 8, 8, 3), ())
  """
  cfg = dict(VIT_PRESETS[preset])
  k_init, k_x, k_y = jax.random.split(jax.random.key(seed), 3)
  module = models.ViT(cfg["patch"], cfg["hidden"], cfg["heads"], cfg["layers"], cfg["classes"])
  x = jax.random.normal(k_x, (cfg["batch"], cfg["image"], cfg["image"], 3), jnp.float32)
  y = jax.random.randint(k_y, (cfg["batch"],), 0, cfg["classes"])
  params = jax.jit(module.init)(k_init, x)["params"]

  def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    logits = module.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["y"]).mean()

  return models.Problem("vit", cfg, params, {"x": x, "y": y}, loss_fn, cfg["batch"], True)


def residual_bytes(loss_fn: Any, params: Any, batch: Any, policy: jmp.Policy,
                   autocast: bool) -> dict[str, int]:
  """Bytes per dtype of what ``jax.vjp`` of the loss keeps, run as the train step runs it.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    params: the float32 params (the differentiated input).
    batch: the batch.
    policy: casts the params inside the differentiated function, and the batch.
    autocast: wrap ``loss_fn`` in ``jmp.autocast(loss_fn, policy.compute_dtype)``.

  Returns:
    ``{dtype name: bytes}`` over the pullback's leaves.

  Examples:
    >>> f = lambda p, b: jnp.sum(b["x"] @ p)  # the gradient is x.T @ 1: x is kept
    >>> p, b = jnp.ones((4, 4)), {"x": jnp.ones((8, 4))}
    >>> residual_bytes(f, p, b, jmp.get_policy("f32"), False)
    {'float32': 128}
    >>> residual_bytes(f, p, b, jmp.get_policy("mixed_bfloat16"), False)
    {'bfloat16': 64}
  """
  fn = jmp.autocast(loss_fn, policy.compute_dtype) if autocast else loss_fn

  def pullback_leaves(p: Any, b: Any) -> list[Any]:
    b = policy.cast_to_compute(b)
    _, pullback = jax.vjp(lambda q: fn(policy.cast_to_compute(q), b), p)
    return jax.tree.leaves(pullback)

  out: dict[str, int] = {}
  for leaf in jax.eval_shape(pullback_leaves, params, batch):
    name = np.dtype(leaf.dtype).name
    out[name] = out.get(name, 0) + int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
  return out


def problem(name: str, preset: str) -> models.Problem:
  return build_vit(preset) if name == "vit" else models.build_problem(name, preset)


def run(model_names: list[str], variants: list[str], preset: str) -> list[dict[str, Any]]:
  """One row per model: each variant's bytes per dtype, total and ratio to fp32."""
  rows = []
  for name in model_names:
    p = problem(name, preset)
    row: dict[str, Any] = dict(model=name, config=p.config, variants={})
    for v in variants:
      policy_name, autocast = POLICIES[v]
      by_dtype = residual_bytes(p.loss_fn, p.params, p.batch, jmp.get_policy(policy_name),
                                autocast)
      row["variants"][v] = dict(bytes=sum(by_dtype.values()), by_dtype=by_dtype)
    base = row["variants"].get("fp32", {}).get("bytes")
    for v in variants:
      row["variants"][v]["vs_fp32"] = row["variants"][v]["bytes"] / base if base else None
    rows.append(row)
  return rows


def bars(rows: list[dict[str, Any]], meaningful: bool) -> list[dict[str, Any]]:
  """The issue's bar: bf16 autocast at most 0.6 of fp32's bytes (where both were measured)."""
  out = []
  for row in rows:
    v = row["variants"]
    if row["model"] in BAR_MODELS and "bf16_autocast" in v and "fp32" in v:
      value = v["bf16_autocast"]["vs_fp32"]
      out.append(dict(what="residual bytes, bf16_autocast / fp32", model=row["model"],
                      value=value, limit=BAR, passed=bool(value <= BAR), meaningful=meaningful))
  return out


def markdown(result: dict[str, Any]) -> str:
  """The Markdown report: per model, MiB per variant, ratio to fp32, float32 share; the bars."""
  variants = result["config"]["variants"]
  lines = [report.meta_line(result["meta"]), "",
           "Residual bytes: what `jax.vjp` of the loss keeps for the backward pass, with the "
           "params cast by the policy inside the differentiated function (as `make_train_step` "
           "runs it). MiB, and in brackets the ratio to fp32 and the MiB kept in float32.", "",
           "| model | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
  for row in result["rows"]:
    cells = []
    for v in variants:
      r = row["variants"][v]
      ratio = "" if r["vs_fp32"] is None else f"{r['vs_fp32']:.3f}, "
      f32 = r["by_dtype"].get("float32", 0) / 2**20
      cells.append(f"{r['bytes'] / 2**20:.2f} ({ratio}f32 {f32:.2f})")
    lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
  if result["bars"]:
    lines += [""] + report.bars_table(result["bars"])
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  """The command-line parser."""
  p = cli.parser(PROG, __doc__, epilog="variants: " + ", ".join(VARIANTS)
                 + "; models: " + ", ".join(MODELS))
  cli.add_common_arguments(p, "the smoke sizes of every model; seconds")
  p.add_argument("--model", default="all", metavar="LIST",
                 help="comma-separated models (listed below), or all (default: %(default)s)")
  return p


def main(argv: list[str] | None = None) -> int:
  """Measures and writes ``residuals-<machine>-<date>.json`` and ``.md``."""
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser()
  args = p.parse_args(argv)
  variants = cli.choose(args.variants, VARIANTS, VARIANTS, "variant")
  model_names = cli.choose(args.model, MODELS, MODELS, "model")
  cli.select_platform(args)
  device = cli.device(args, p)
  out = report.output_dir(args.out, args.smoke)
  rows = run(model_names, variants, "smoke" if args.smoke else "cpu")
  result = dict(meta=report.meta(cli.command(PROG, argv), device, smoke=args.smoke),
                config=dict(cli.args_record(args), variants=variants, models=model_names),
                rows=rows, bars=bars(rows, not args.smoke))
  stem = out / f"residuals-{report.machine_name(device)}-{result['meta']['date']}"
  report.publish(result, stem, markdown(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
