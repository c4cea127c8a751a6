"""Small helpers shared by the examples: the command line, progress bars, timing and tables."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import tqdm

ROOT = Path(__file__).resolve().parents[1]
# Where results go by default: out/ at the repository root, whatever the working
# directory; git ignores it. The committed results are regenerated with an
# explicit ``--out examples/results``.
DEFAULT_OUT = ROOT / "out"
OUT_HELP = ("results folder (default: out/ at the repository root, which git ignores; "
            "pass --out examples/results to regenerate the committed results; "
            "a --smoke run writes nothing unless --out is given)")


# Lean master weights (--masters): TrainState.create arguments, run under the bf16 policy.
MASTERS = {
    "f32": {},
    "bf16-nearest": dict(master_dtype=jnp.bfloat16, rounding="nearest"),
    "bf16-stochastic": dict(master_dtype=jnp.bfloat16, rounding="stochastic"),
    "bf16-kahan": dict(master_dtype=jnp.bfloat16, rounding="kahan"),
}
LEAN_MASTERS = tuple(m for m in MASTERS if m != "f32")


def parser(doc: str) -> argparse.ArgumentParser:
  """An example's parser; its description is the first two paragraphs of ``doc``.

  Those are the summary line and the example commands, kept as written. Every
  option's help states its default, as ``(default: %(default)s)``.
  """
  return argparse.ArgumentParser(description="\n\n".join(doc.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def add_scale_arguments(p: argparse.ArgumentParser) -> None:
  """Adds ``--init-scale`` and ``--growth-interval`` (the f16 mode's dynamic loss scale)."""
  p.add_argument("--init-scale", type=float, default=2.0**15,
                 help="f16 initial loss scale (default: %(default)s)")
  p.add_argument("--growth-interval", type=int, default=200,
                 help="f16 finite steps per growth of the loss scale (default: %(default)s)")


def add_masters_argument(p: argparse.ArgumentParser, results: str) -> None:
  """Adds ``--masters``; check its value with :func:`masters_list`."""
  p.add_argument("--masters", default="",
                 help="also train the bf16 mode with lean master weights, a comma-separated "
                      f"subset of {', '.join(LEAN_MASTERS)} (results go to {results}.*) "
                      "(default: none)")


def masters_list(p: argparse.ArgumentParser, text: str) -> list[str]:
  """The ``--masters`` names, in the order given; a usage error for an unknown one."""
  names = [m for m in text.split(",") if m]
  bad = [m for m in names if m not in LEAN_MASTERS]
  if bad:
    p.error(f"--masters must be a comma-separated subset of {LEAN_MASTERS}, got {bad[0]!r}")
  return names


def add_output_arguments(p: argparse.ArgumentParser, smoke_help: str) -> None:
  """Adds ``--smoke``, ``--out`` and ``--no-progress``; see :func:`output_dir`."""
  p.add_argument("--smoke", action="store_true", help=smoke_help)
  p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
  p.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def args_record(args: argparse.Namespace) -> dict[str, Any]:
  """The parsed options as a JSON-ready dict (paths as strings).

  Examples:
    >>> args_record(argparse.Namespace(out=Path("out"), steps=3))
    {'out': 'out', 'steps': 3}
  """
  return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def output_dir(out: Path | None, smoke: bool) -> Path | None:
  """Where a run writes its files.

  Args:
    out: the ``--out`` argument, or None if it was not given.
    smoke: whether this is a ``--smoke`` run.

  Returns:
    ``out`` if given, else None (write nothing) for a smoke run, else
    :data:`DEFAULT_OUT`.

  Examples:
    >>> output_dir(None, smoke=False) == DEFAULT_OUT
    True
    >>> output_dir(None, smoke=True) is None
    True
    >>> str(output_dir(Path("examples/results"), smoke=True))
    'examples/results'
  """
  if out is not None:
    return out
  return None if smoke else DEFAULT_OUT


def announce_output(out: Path | None) -> None:
  """Prints where the results will go, before any work starts."""
  if out is None:
    print("smoke run: no files will be written (pass --out DIR to write them)", flush=True)
  else:
    print(f"results will be written to {out}", flush=True)


def progress(iterable: Iterable[Any], *, desc: str, total: int, enabled: bool = True):
  """A tqdm progress bar over ``iterable`` (a plain iterator when disabled)."""
  return tqdm.tqdm(iterable, desc=desc, total=total, disable=not enabled, leave=False, ncols=90)


def show_skips(bar: Any, metrics: Mapping[str, Any]) -> None:
  """Shows the current run of skipped steps (``consecutive_skips``) on a progress bar.

  The examples time each step, so the metrics are already on the host side of
  a finished step: reading one costs no extra synchronisation.
  """
  if "consecutive_skips" in metrics and isinstance(bar, tqdm.tqdm):
    bar.set_postfix_str(f"skips in a row: {int(metrics['consecutive_skips'])}", refresh=False)


def timed_step(step: Callable[..., Any], *args: Any) -> tuple[Any, float]:
  """Calls ``step(*args)``, waits for the result and returns (result, seconds)."""
  start = time.perf_counter()
  out = jax.block_until_ready(step(*args))
  return out, time.perf_counter() - start


def median_ms(seconds: Sequence[float], warmup: int) -> float:
  """Median of ``seconds[warmup:]`` in milliseconds (compilation stays out)."""
  kept = list(seconds[warmup:]) or list(seconds[-1:])
  return 1e3 * statistics.median(kept)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub Markdown table whose columns line up in a terminal too."""
  cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
  line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
  rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def machine() -> str:
  """A one-line description of where the numbers were measured."""
  dev = jax.devices()[0]
  return f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), {platform.machine()}"


def write_results(out: Path, name: str, table: str, payload: dict[str, Any]) -> list[Path]:
  """Writes ``name.md`` (the table) and ``name.json`` (``payload``) under ``out``."""
  out.mkdir(parents=True, exist_ok=True)
  md, js = out / f"{name}.md", out / f"{name}.json"
  md.write_text(f"{table}\n\nMeasured on {machine()}.\n")
  js.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
  return [md, js]
