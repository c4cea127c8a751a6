"""Command-line pieces shared by the benchmark scripts.

Every script takes ``--variants``, ``--device``, ``--out`` and ``--smoke`` with
the same meaning; help texts show their defaults.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys
from typing import Any

import jax

from benchmarks import report


def positive_int(text: str) -> int:
  """An ``argparse`` type: an integer >= 1.

  Examples:
    >>> positive_int("3")
    3
    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected an integer >= 1, got '0'
  """
  try:
    value = int(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from e
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
  return value


def positive_float(text: str) -> float:
  """An ``argparse`` type: a finite number > 0.

  Examples:
    >>> positive_float("0.5")
    0.5
    >>> positive_float("-1")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected a number > 0, got '-1'
  """
  try:
    value = float(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from e
  if not (0 < value < float("inf")):
    raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
  return value


def choose(text: str, allowed: tuple[str, ...], default: tuple[str, ...], what: str) -> list[str]:
  """Parses a comma-separated choice from ``allowed``, in the order of ``allowed``.

  Args:
    text: ``"all"`` (gives ``default``) or names separated by commas.
    allowed: the names that may be chosen, in canonical order.
    default: what ``"all"`` stands for.
    what: what the names are, for the error message.

  Returns:
    The chosen names, each once, ordered as in ``allowed``.

  Raises:
    ValueError: for an empty list or an unknown name.

  Examples:
    >>> choose("c, a", ("a", "b", "c"), ("a",), "variant")
    ['a', 'c']
    >>> choose("all", ("a", "b", "c"), ("a",), "variant")
    ['a']
    >>> choose("d", ("a", "b"), ("a",), "variant")
    Traceback (most recent call last):
    ...
    ValueError: unknown variant(s) ['d']; choose from a, b
  """
  if text == "all":
    return list(default)
  names = [n.strip() for n in text.split(",") if n.strip()]
  bad = [n for n in names if n not in allowed]
  if bad or not names:
    raise ValueError(f"unknown {what}(s) {bad}; choose from {', '.join(allowed)}")
  return [n for n in allowed if n in names]


def parser(prog: str, doc: str, epilog: str) -> argparse.ArgumentParser:
  """A parser whose description is the first paragraph of ``doc``."""
  return argparse.ArgumentParser(
      prog=prog,
      description=doc.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=epilog,
  )


def add_common_arguments(
    p: argparse.ArgumentParser, smoke_help: str, variants: bool = True
) -> None:
  """Adds ``--variants`` (if ``variants``), ``--device``, ``--out`` and ``--smoke`` to ``p``.

  List the variants in the parser's epilog.
  """
  if variants:
    p.add_argument(
        "--variants",
        default="all",
        metavar="LIST",
        help="comma-separated variants to run (listed below), or all (default: %(default)s)",
    )
  p.add_argument(
      "--device",
      default="cpu",
      choices=("cpu", "gpu"),
      help="where to run; cpu hides any GPU from JAX (default: %(default)s)",
  )
  p.add_argument("--out", type=pathlib.Path, help=report.OUT_HELP)
  p.add_argument("--smoke", action="store_true", help=smoke_help)


def add_timing_arguments(
    p: argparse.ArgumentParser, flag: str, repeats: int, note: str = ""
) -> None:
  """Adds ``flag`` (timed repeats), ``--warmup`` and ``--sample-seconds`` to ``p``."""
  p.add_argument(
      flag,
      type=positive_int,
      default=repeats,
      help=f"timed repeats per variant (default: %(default)s{note})",
  )
  p.add_argument(
      "--warmup", type=positive_int, default=3, help="warm-up steps (default: %(default)s)"
  )
  p.add_argument(
      "--sample-seconds",
      type=positive_float,
      default=0.1,
      help="target length of one timed sample; sets the steps per sample (default: %(default)s)",
  )


def select_platform(args: argparse.Namespace) -> None:
  """Keeps JAX on the CPU for ``--device cpu``; call it before JAX picks a device."""
  if args.device == "cpu":
    jax.config.update("jax_platforms", "cpu")


def device(args: argparse.Namespace, p: argparse.ArgumentParser) -> Any:
  """JAX's default device; exits with a usage error if ``--device gpu`` has no GPU."""
  d = jax.devices()[0]
  if args.device == "gpu" and d.platform != "gpu":
    p.error(f"--device gpu, but JAX's default device is {d} ({d.platform})")
  return d


def command(prog: str, argv: list[str]) -> str:
  """The command line, for the record.

  Examples:
    >>> command("python -m benchmarks.run", ["--model", "mlp"])
    'python -m benchmarks.run --model mlp'
  """
  return prog + ("" if not argv else " " + shlex.join(argv))


def args_record(args: argparse.Namespace) -> dict[str, Any]:
  """The parsed options as a JSON-ready dict (paths as strings).

  Examples:
    >>> args_record(argparse.Namespace(out=pathlib.Path("out"), steps=3))
    {'out': 'out', 'steps': 3}
  """
  return {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}


def progress_bar(total: int, desc: str) -> Any:
  """A tqdm progress bar on stderr."""
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel

  return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)
