"""The findings of :func:`jmp_lite.precision_lint`: one risky operation, and the list that prints them grouped."""

from __future__ import annotations

from typing import NamedTuple, Union

_UNKNOWN = "<unknown source>"
# How a float32 matmul's reason starts (see lint's ``_rank_causes``): such lines print first.
PINNED = "runs in float32"


class LintFinding(NamedTuple):
  """One risky operation found by :func:`precision_lint`.

  Attributes:
    op: the primitive (``"dot_general"``, ``"exp"``, ...), ``"softmax/logsumexp"``
      for an exp followed by a sum, or ``"loss"`` for the output.
    reason: what is risky and what to do.
    source: ``"file:line (function)"`` of the user code that emitted it, or
      ``None`` if unknown.
  """

  op: str
  reason: str
  source: Union[str, None]

  def __str__(self) -> str:
    return f"{self.source or _UNKNOWN}: {self.op}: {self.reason}"


class LintFindings(list[LintFinding]):
  """The findings of :func:`precision_lint`: a list of :class:`LintFinding`, in program order.

  It is a plain ``list`` (index it, iterate it, compare it with a list); only
  printing differs: ``str(findings)`` (and ``print``) groups the findings
  that differ only in their source, the same op for the same reason (a
  12-layer model's 12 float32 matmuls), into one line with a count and the
  first few sources (:meth:`summary`).
  """

  def summary(self, max_sources: int = 3) -> str:
    """One line per distinct ``(op, reason)``: float32 matmuls first, then in order of first appearance.

    The lines of matmuls and convolutions that run in float32 under a half
    policy come first, the one that explains the most of them first: a
    single cause often explains them all.

    A finding seen once prints as ``str(finding)``; one seen ``n`` times as
    ``"src1, src2, src3 and k more places: op (n times): reason"``, with the
    distinct sources in program order.

    Args:
      max_sources: how many distinct sources a line names (at least 1).

    Returns:
      The lines, joined by newlines (``""`` for no findings).

    Raises:
      ValueError: if ``max_sources`` is not an int >= 1.

    Examples:
      >>> findings = LintFindings([LintFinding("exp", "overflows", f"m.py:{i} (f)")
      ...                          for i in (1, 2, 3, 4, 1)])
      >>> print(findings.summary(max_sources=2))
      m.py:1 (f), m.py:2 (f) and 2 more places: exp (5 times): overflows
      >>> len(findings), findings[1].source
      (5, 'm.py:2 (f)')
    """
    if isinstance(max_sources, bool) or not isinstance(max_sources, int) or max_sources < 1:
      raise ValueError(f"max_sources must be an int >= 1, got {max_sources!r}")
    groups: dict[tuple[str, str], list[LintFinding]] = {}
    for f in self:
      groups.setdefault((f.op, f.reason), []).append(f)
    order = sorted(groups.items(), key=lambda g: -len(g[1]) if g[0][1].startswith(PINNED) else 0)
    lines = []
    for (op, reason), members in order:
      if len(members) == 1:
        lines.append(str(members[0]))
        continue
      sources = list(dict.fromkeys(m.source or _UNKNOWN for m in members))
      where = ", ".join(sources[:max_sources])
      if len(sources) > max_sources:
        where += f" and {len(sources) - max_sources} more places"
      lines.append(f"{where}: {op} ({len(members)} times): {reason}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.summary()
