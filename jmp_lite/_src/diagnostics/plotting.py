"""Matplotlib drawing of a log2 histogram against a dtype's range (an optional dependency).

``GradientReport.plot`` calls it with plain data (counts, edges, numbers and
labels), so this module imports nothing from the rest of the library, and
matplotlib only when something is drawn.
"""

from __future__ import annotations

import math
import os
from typing import Any, Union

import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

_MATPLOTLIB_MSG = (
    "GradientReport.plot needs matplotlib, an optional dependency: "
    "pip install 'jmp_lite[examples]' (or pip install matplotlib)"
)


def _pyplot(own_figure: bool) -> Any:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    if own_figure:
      matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(_MATPLOTLIB_MSG) from e
  return plt


def plot_log2_histogram(
    counts: ArrayLike,
    edges: ArrayLike,
    *,
    loss_scale: float,
    dtype: DTypeLike,
    title: str,
    scale_label: str,
    path: Union[str, os.PathLike[str], None] = None,
    ax: Any = None,
) -> Any:
  """Draws a histogram of log2|g|, and the same moved by ``log2(loss_scale)``, against ``dtype``.

  See ``GradientReport.plot``, its one caller, for what the figure shows.

  Args:
    counts: the counts of the bins.
    edges: the ``len(counts) + 1`` bin edges, in log2 units.
    loss_scale: the scale the filled bars are moved by (a positive number).
    dtype: the floating dtype whose subnormal and normal ranges are shaded.
    title: the axes' title.
    scale_label: the legend label of the moved histogram.
    path: where to write the PNG; ``None`` writes nothing.
    ax: a matplotlib ``Axes`` to draw into; by default a new figure.

  Returns:
    The matplotlib ``Figure``.
  """
  plt = _pyplot(own_figure=ax is None)
  counts = np.asarray(counts)
  shift = math.log2(loss_scale)
  edges = np.asarray(edges, np.float64)
  info = jnp.finfo(dtype)
  lo_sub, lo_norm = math.log2(float(info.smallest_subnormal)), math.log2(float(info.tiny))
  hi = math.log2(float(info.max))
  own = ax is None
  if own:
    fig, ax = plt.subplots(figsize=(7, 4))
  else:
    fig = ax.figure
  nonempty = np.nonzero(counts)[0]
  if nonempty.size:
    x_min = min(edges[nonempty[0]], edges[nonempty[0]] + shift, lo_sub) - 4
    x_max = max(edges[nonempty[-1] + 1], edges[nonempty[-1] + 1] + shift, hi) + 4
  else:
    x_min, x_max = lo_sub - 4, hi + 4
  name = np.dtype(dtype).name
  ax.axvspan(lo_sub, lo_norm, color="tab:olive", alpha=0.15, label=f"{name} subnormal")
  ax.axvspan(lo_norm, hi, color="tab:green", alpha=0.15, label=f"{name} normal")
  ax.axvspan(x_min, lo_sub, color="tab:red", alpha=0.08, label="flushes to 0")
  ax.axvspan(hi, x_max, color="tab:purple", alpha=0.08, label="overflows")
  ax.stairs(counts, edges, color="0.4", label="unscaled gradients")
  ax.stairs(counts, edges + shift, fill=True, color="tab:blue", alpha=0.7, label=scale_label)
  if nonempty.size and shift:
    peak = int(np.argmax(counts))
    x0 = 0.5 * (edges[peak] + edges[peak + 1])
    y = 0.5 * counts[peak]
    ax.annotate("", xy=(x0 + shift, y), xytext=(x0, y),
                arrowprops=dict(arrowstyle="->", color="black"))
  ax.set_xlim(x_min, x_max)
  ax.set_xlabel("log2 |value|")
  ax.set_ylabel("elements")
  ax.set_title(title, fontsize=10)
  ax.legend(fontsize=7, loc="upper right", framealpha=0.9)
  if path is not None:
    if own:
      fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    if own:
      plt.close(fig)
  return fig
