"""Independent brute-force checker of released tables (CONCEPTS §9.8); imports nothing from the algorithms.

Groups published rows by their exact QI strings, checks k, the ℓ-diversity variants and t-closeness (EMD as
a transportation linear program, so it shares no code or formula with the algorithms' closed forms), and
checks that every original value satisfies its written form (contract §8).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog


@dataclass(frozen=True)
class Classes:
    """Equivalence classes: QI string tuple → list of sensitive values (or row ids)."""

    members: dict[tuple[str, ...], list[str]]

    @property
    def sizes(self) -> list[int]:
        return [len(v) for v in self.members.values()]


def group(rows: Sequence[Mapping[str, str]], qi_columns: Sequence[str], value_column: str) -> Classes:
    out: dict[tuple[str, ...], list[str]] = {}
    for r in rows:
        out.setdefault(tuple(r[c] for c in qi_columns), []).append(r[value_column])
    return Classes(out)


def distinct_l(values: Sequence[str]) -> int:
    return len(set(values))


def entropy_l(values: Sequence[str]) -> float:
    n = len(values)
    h = -sum((c / n) * math.log(c / n) for c in Counter(values).values())
    return math.exp(h)


def recursive_ok(values: Sequence[str], c: float, l: int) -> bool:  # noqa: E741
    r = sorted(Counter(values).values(), reverse=True)
    if len(r) < l:
        return False
    return r[0] < c * sum(r[l - 1 :])


def emd_lp(p: Sequence[float], q: Sequence[float], ground: Sequence[Sequence[float]]) -> float:
    """Earth mover's distance by linear programming: min Σ f_ij d_ij, rows sum to p, columns to q."""
    m = len(p)
    cost = np.asarray(ground, dtype=float).reshape(-1)
    a_eq = []
    b_eq = []
    for i in range(m):
        row = np.zeros((m, m))
        row[i, :] = 1
        a_eq.append(row.reshape(-1))
        b_eq.append(p[i])
    for j in range(m):
        col = np.zeros((m, m))
        col[:, j] = 1
        a_eq.append(col.reshape(-1))
        b_eq.append(q[j])
    res = linprog(cost, A_eq=np.asarray(a_eq), b_eq=np.asarray(b_eq), bounds=(0, None), method="highs")
    assert res.success
    return float(res.fun)


def ordered_ground(domain: Sequence[float]) -> list[list[float]]:
    m = len(domain)
    return [[abs(i - j) / (m - 1) if m > 1 else 0.0 for j in range(m)] for i in range(m)]


def equal_ground(m: int) -> list[list[float]]:
    return [[0.0 if i == j else 1.0 for j in range(m)] for i in range(m)]


def tree_ground(leaves: Sequence[str], ancestors: Mapping[str, Sequence[str]]) -> list[list[float]]:
    """Ground distance = level of the lowest common ancestor / height (leaf → ancestors up to the root)."""
    height = len(next(iter(ancestors.values())))
    out = []
    for a in leaves:
        row = []
        for b in leaves:
            if a == b:
                row.append(0.0)
                continue
            pa, pb = list(ancestors[a]), list(ancestors[b])
            level = next(i + 1 for i in range(height) if pa[i:] == pb[i:])
            row.append(level / height)
        out.append(row)
    return out


def max_emd(classes: Classes, domain: Sequence[str], ground: Sequence[Sequence[float]]) -> float:
    all_values = [v for vs in classes.members.values() for v in vs]
    total = Counter(all_values)
    q = [total[d] / len(all_values) for d in domain]
    worst = 0.0
    for vs in classes.members.values():
        cnt = Counter(vs)
        p = [cnt[d] / len(vs) for d in domain]
        worst = max(worst, emd_lp(p, q, ground))
    return worst


def satisfies(written: str, original: str, labels: Callable[[str], Sequence[str]] | None = None) -> bool:
    """Does the original value satisfy the written form (exact, interval, set, prefix, ``*``, or a label)?"""
    if written == "*":
        return True
    if labels is not None and written in labels(original):
        return True
    if len(written) >= 5 and written[0] == "[" and written[-1] in ")]" and "," in written:
        lo_s, hi_s = written[1:-1].split(",")
        x, lo, hi = float(original), float(lo_s), float(hi_s)
        return lo <= x < hi if written[-1] == ")" else lo <= x <= hi
    if written.startswith("{") and written.endswith("}"):
        return original in written[1:-1].split("|")
    if written.endswith("*"):
        return original.startswith(written.rstrip("*"))
    if written == original:
        return True
    try:
        return float(written) == float(original)
    except ValueError:
        return False


def check_truthful(
    released: Sequence[Mapping[str, str]],
    originals: Mapping[str, Mapping[str, object]],
    qi_columns: Sequence[str],
    id_column: str = "_rid",
    labels: Mapping[str, Callable[[str], Sequence[str]]] | None = None,
) -> list[str]:
    """Violations of 'every original value satisfies its written form'."""
    bad = []
    for r in released:
        orig = originals[r[id_column]]
        for c in qi_columns:
            lab = labels.get(c) if labels else None
            if not satisfies(r[c], str(orig[c]), lab):
                bad.append(f"row {r[id_column]} column {c}: {orig[c]!r} does not satisfy {r[c]!r}")
    return bad
