"""The oracle's report: the matrix's ratios (median and worst), the sweep, the cooldown, bars."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks import bars as bars_lib
from benchmarks import report
from benchmarks.optim_oracle import variants as variants_lib

RATIO_WORST_LIMIT = 1.0
RATIO_MEDIAN_LIMIT = 0.6
SWEEP_LIMIT = 1.5
COOLDOWN_RISE_LIMIT = 0.01  # the held-out loss rises at most 1% while the lr falls to 0
CODED_JMP = ("jmp_int8", "jmp_float8", "jmp_int4")
FAMILY_NAMES = tuple(n for n, v in variants_lib.VARIANTS.items()
                     if v.side == "jax" and v.family != "adamw" and v.format is not None)


def ratio_summary(problems: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per rival pair: each problem's ratio, their median, and the worst one and its problem."""
  out = {}
  for ours, theirs in variants_lib.RIVALS.items():
    each = {p["problem"]: p["ratios"][ours] for p in problems if ours in p["ratios"]}
    if not each:
      continue
    worst = max(each, key=lambda k: (np.nan_to_num(each[k], nan=np.inf), k))
    out[ours] = dict(rival=theirs, by_problem=each, median=float(np.median(list(each.values()))),
                     worst=each[worst], worst_problem=worst)
  return out


def family_summary(problems: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per coded lion / sgd-momentum variant: median and worst drift (mean over seeds) over problems."""
  out = {}
  for n in FAMILY_NAMES:
    each = {p["problem"]: p["variants"][n]["drift"] for p in problems if n in p["variants"]}
    if each:
      worst = max(each, key=lambda k: (np.nan_to_num(each[k], nan=np.inf), k))
      out[n] = dict(median=float(np.median(list(each.values()))), worst=each[worst],
                    worst_problem=worst)
  return out


def coded_mismatches(problems: list[dict[str, Any]]) -> list[str]:
  """Problems where a jmp variant and its torchao rival coded different parameters."""
  return [p["problem"] for p in problems
          if any(ours in p["coded"] and theirs in p["coded"]
                 and p["coded"][ours] != p["coded"][theirs]
                 for ours, theirs in variants_lib.RIVALS.items())]


def check_bars(result: dict[str, Any], meaningful: bool) -> list[dict[str, Any]]:
  """Ratios per rival pair, each jmp format's worst sweep step and cooldown rise, coded sets."""
  found = []
  for ours, s in result["summary"]["ratios"].items():
    what = f"{ours} drift / {s['rival']} drift"
    found.append(bars_lib.bar("optim_oracle", f"{what}, worst problem ({s['worst_problem']})",
                              s["worst"], RATIO_WORST_LIMIT, meaningful, model="matrix"))
    found.append(bars_lib.bar("optim_oracle", f"{what}, median over problems", s["median"],
                              RATIO_MEDIAN_LIMIT, meaningful, model="matrix"))
  sweep = result.get("sweep")
  for n in CODED_JMP:
    if sweep is not None and n in sweep["variants"]:
      vs = sweep["variants"][n]["vs_fp32"]
      i = int(np.argmax(np.nan_to_num(vs, nan=np.inf)))
      found.append(bars_lib.bar("optim_oracle", f"{n}: largest step / fp32 Adam's, worst of "
                                f"{len(vs)} ratios (at {sweep['ratios'][i]:.2g})", vs[i],
                                SWEEP_LIMIT, meaningful, model="sweep"))
  if result["problems"] and result["summary"]["ratios"]:
    bad = coded_mismatches(result["problems"])
    found.append(bars_lib.bar("optim_oracle", "problems where jmp and torchao coded different "
                              f"parameters{': ' + ', '.join(bad) if bad else ''}", len(bad), 0,
                              meaningful, model="matrix"))
  cooldown = result.get("cooldown")
  for n in CODED_JMP:
    if cooldown is not None and n in cooldown["variants"]:
      found.append(bars_lib.bar("optim_oracle", f"{n}: largest rise of the held-out loss in the "
                                f"decay to lr 0, worst seed of {len(cooldown['seeds'])}",
                                cooldown["variants"][n]["rise_worst"], COOLDOWN_RISE_LIMIT,
                                meaningful, model="cooldown"))
  return found


def _pct(x: float) -> str:
  return f"{100 * x:.2f}%"


def _coded(p: dict[str, Any]) -> str:
  jmp_side = next((p["coded"][n] for n in variants_lib.RIVALS if n in p["coded"]), None)
  torch_side = next((p["coded"][n] for n in variants_lib.RIVALS.values() if n in p["coded"]), None)
  shown = jmp_side if jmp_side is not None else torch_side
  if shown is None:
    return "n/a"
  text = ", ".join(f"{k} ({p['sizes'][k]})" for k in shown)
  if jmp_side is not None and torch_side is not None and jmp_side != torch_side:
    text = f"jmp: {text}; torchao: {', '.join(torch_side)}"
  return text


_SHORT = {"jmp_int8": "int8", "jmp_float8": "float8", "jmp_int4": "int4",
          "torchao_adamw8bit": "AdamW8bit", "torchao_adamwfp8": "AdamWFp8",
          "torchao_adamw4bit": "AdamW4bit"}


def matrix_lines(problems: list[dict[str, Any]]) -> list[str]:
  """One row per problem: its cell, the drifts (mean, largest) and the ratios of each rival pair run."""
  pairs = [(ours, theirs) for ours, theirs in variants_lib.RIVALS.items()
           if any(ours in p["variants"] or theirs in p["variants"] for p in problems)]
  head = "".join(f" {_SHORT[o]} | {_SHORT[t]} | ratio |" for o, t in pairs)
  lines = [f"| problem | model | steps | lr | wd |{head} torch vs optax AdamW | coded (elements) |",
           "|---" * (7 + 3 * len(pairs)) + "|"]
  for p in problems:
    v, r = p["variants"], p["ratios"]

    def cell(n: str, v: dict[str, Any] = v) -> str:
      return f"{_pct(v[n]['drift'])} ({_pct(v[n]['drift_max'])})" if n in v else "n/a"

    cross = p.get("torch_vs_optax_adamw")
    cells = "".join(f" {cell(o)} | {cell(t)} | {r.get(o, float('nan')):.2f}x |" for o, t in pairs)
    lines.append(
        f"| {p['problem']} | {p['describe']} | {p['steps']} | {p['lr']:g} | "
        f"{p['weight_decay']:g} |{cells} {'n/a' if cross is None else _pct(cross)} | {_coded(p)} |")
  return lines


def loss_lines(problems: list[dict[str, Any]]) -> list[str]:
  """Final held-out loss per problem and variant (means over seeds)."""
  names = [n for n in variants_lib.VARIANTS if any(n in p["variants"] for p in problems)]
  lines = ["| problem | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for p in problems:
    lines.append(f"| {p['problem']} | " + " | ".join(
        f"{p['variants'][n]['loss']:.4g}" if n in p["variants"] else "n/a" for n in names) + " |")
  return lines


def family_lines(problems: list[dict[str, Any]]) -> list[str]:
  """Drift of coded lion and sgd-momentum from their float32 selves, per problem."""
  names = [n for n in FAMILY_NAMES if any(n in p["variants"] for p in problems)]
  if not names:
    return []
  lines = ["| problem | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for p in problems:
    v = p["variants"]
    lines.append(f"| {p['problem']} | " + " | ".join(
        f"{_pct(v[n]['drift'])} ({_pct(v[n]['drift_max'])})" if n in v else "n/a"
        for n in names) + " |")
  return lines


def sweep_lines(sweep: dict[str, Any]) -> list[str]:
  """One row per ratio: float32 Adam's largest step over lr, and each coded optimizer's over it."""
  v = sweep["variants"]
  names = [n for n in v if variants_lib.VARIANTS[n].format is not None]
  lines = ["| ratio | fp32 Adam's largest step / lr | " + " | ".join(names) + " |",
           "|---" * (len(names) + 2) + "|"]
  ref = v.get("optax_adamw") or v.get("torch_adamw")
  for i, r in enumerate(sweep["ratios"]):
    lines.append(f"| {r:.3g} | {ref['largest'][i] / sweep['lr']:.3f} | " + " | ".join(
        f"{v[n]['vs_fp32'][i]:.2f}x" for n in names) + " |")
  return lines


def cooldown_lines(cooldown: dict[str, Any]) -> list[str]:
  """The cooldown: what it ran, one row per variant, the median loss at each point, the seeds."""
  warmup, start = cooldown["phases"]
  steps, points, seeds = cooldown["steps"], cooldown["points"], cooldown["seeds"]
  lines = [
      f"**Cooldown** on {cooldown['problem']}, {steps} steps, seeds {', '.join(map(str, seeds))}: "
      f"a warmup-stable-decay schedule, lr linear from 0 at step 0 to the peak "
      f"{cooldown['peak_lr']:g} at step {warmup} ({cooldown['peak_lr'] / cooldown['matrix_lr']:g}x "
      f"the matrix's constant {cooldown['matrix_lr']:g}), then constant, "
      f"then linear from the peak at step {start} to 0 at step {steps - 1} (the last "
      f"{steps - start} steps); weight decay {cooldown['weight_decay']:g}. Both sides take step "
      "t at the same float32 lr, from one table: an optax schedule reads it at its count, torch's "
      "param groups are set to it before each step (torchao's lr tensor filled in place). "
      f"Held-out loss after {points[0]} updates (the decay's start) and after "
      f"{len(points) - 1} of the decay's steps. Largest rise: the most a loss rose over the lowest "
      "before it in the decay, worst and median over seeds. Final loss: median over seeds; over "
      "the same side's float32 AdamW's, median and worst. Diverged: seeds with a loss not finite "
      "or above twice the decay start's.", "",
      "| variant | optimizer | largest rise, worst | median | final loss | final / fp32, median |"
      " worst | diverged | coded |", "|---" * 9 + "|"]
  v = cooldown["variants"]
  for n, c in v.items():
    lines.append(
        f"| {n} | {variants_lib.VARIANTS[n].what} | {_pct(c['rise_worst'])} | "
        f"{_pct(c['rise_median'])} | {c['final']:.4f} | {c['vs_fp32_median']:.4f}x | "
        f"{c['vs_fp32_worst']:.4f}x | {', '.join(map(str, c['diverged'])) or 'none'} | "
        f"{', '.join(c['coded']) or 'none'} |")
  lines += ["", "Held-out loss through the decay (median over seeds), by updates done:", "",
            "| variant | " + " | ".join(map(str, points)) + " |", "|---" * (len(points) + 1) + "|"]
  lines += [f"| {n} | " + " | ".join(f"{x:.4f}" for x in c["curve"]) + " |" for n, c in v.items()]
  lines += ["", "Largest rise seed by seed:", ""]
  lines += [f"- {n}: " + ", ".join(_pct(s["rise"]) for s in c["by_seed"]) for n, c in v.items()]
  return lines


def markdown(result: dict[str, Any]) -> str:
  """The report: summary, the matrix, final losses, lion and sgd, the sweep, the cooldown, bars."""
  lines = [report.meta_line(result["meta"]), "", f"Measured at commit `{result['meta']['commit']}`.",
           ""]
  problems, summary = result["problems"], result["summary"]
  if problems:
    lines += [
        f"**Drift** over {len(problems)} problems, {len(problems[0]['seeds'])} seeds each: the "
        "distance of the final parameters from the same side's float32 run (`optax.adamw` for "
        "jmp, `torch.optim.AdamW` for torchao) over the distance that run moved them; the mean "
        "over seeds, the largest in brackets. Ratio: jmp's mean drift over torchao's. Both sides "
        "get the gradients of their own parameters from the same jitted JAX function, on the same "
        "batches; torchao ran eagerly (`torch.compile` replaced by the identity).", ""]
    for ours, s in summary["ratios"].items():
      lines.append(f"- {ours} / {s['rival']}: median **{s['median']:.2f}x**, worst "
                   f"**{s['worst']:.2f}x** ({s['worst_problem']}).")
    lines += ["", *matrix_lines(problems), "", "Ratio seed by seed:", ""]
    for p in problems:
      lines.append(f"- {p['problem']}: " + "; ".join(
          f"{n} " + ", ".join(f"{x:.2f}" for x in xs) for n, xs in p["ratios_by_seed"].items()))
    lines += ["", "**Final held-out loss** (mean over seeds):", "", *loss_lines(problems)]
    fam = family_lines(problems)
    if fam:
      lines += ["", "**Lion and sgd with momentum**, coded, against their float32 selves "
                "(lion at lr / 10, sgd at 10 lr, momentum 0.9; drift as above):", ""]
      for n, s in summary["families"].items():
        lines.append(f"- {n}: median {_pct(s['median'])}, worst {_pct(s['worst'])} "
                     f"({s['worst_problem']}).")
      lines += ["", *fam]
  sweep = result.get("sweep")
  if sweep is not None:
    lines += ["", f"**Mixed-magnitude sweep**: Adam at lr {sweep['lr']:g}, {sweep['steps']} "
              f"steps, on {sweep['rows']} blocks of 256 per ratio whose even columns see "
              "gradients of 1 and odd columns of the ratio (times uniform noise in [0.5, 1.5]); "
              "each optimizer's largest step over the same side's float32 Adam's.", "",
              *sweep_lines(sweep)]
  cooldown = result.get("cooldown")
  if cooldown is not None:
    lines += ["", *cooldown_lines(cooldown)]
  lines += ["", *report.bars_table(result["bars"])]
  return "\n".join(lines) + "\n"
