"""The table every algorithm works on: QI columns, lazily encoded hierarchies and axes, criteria, budget."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.tabular._errors import InvalidTableInput
from kcloak.cloaking.tabular.criteria import CriteriaSet
from kcloak.cloaking.tabular.hierarchy import (
    CategoricalHierarchy,
    EncodedHierarchy,
    Hierarchy,
    default_hierarchy,
    parse_numbers,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

QIKind = Literal["numeric", "time", "categorical", "latlon"]
_SET_CHARS = frozenset("|{}[]")


@dataclass(frozen=True, slots=True)
class QuasiIdentifier:
    """One quasi-identifier: a column, or a (lat, lon) column pair for ``kind="latlon"`` (CONCEPTS §8.1).

    ``hierarchy`` is used by the hierarchy-based algorithms (Samarati, Incognito, OLA, KACA); when None a
    default is built from the data (:func:`kcloak.cloaking.tabular.hierarchy.default_hierarchy`). Mondrian uses a
    categorical hierarchy's leaf order as the attribute's order.
    """

    name: str
    kind: QIKind
    columns: tuple[str, ...]
    hierarchy: Hierarchy | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("numeric", "time", "categorical", "latlon"):
            raise InvalidTableInput(f"quasi-identifier {self.name!r}: unknown kind {self.kind!r}")
        want = 2 if self.kind == "latlon" else 1
        if len(self.columns) != want:
            raise InvalidTableInput(f"quasi-identifier {self.name!r}: kind {self.kind} needs {want} column(s)")
        if self.hierarchy is not None and self.hierarchy.n_columns != want:
            raise InvalidTableInput(
                f"quasi-identifier {self.name!r}: hierarchy is for {self.hierarchy.n_columns} column(s)"
            )


@dataclass(frozen=True, slots=True)
class Axis:
    """One ordered dimension for Mondrian/MDAV: numbers as floats, categories as ranks in their order."""

    column: str
    qi: int
    categorical: bool
    integral: bool
    values: FloatArray
    labels: tuple[str, ...]


@dataclass(slots=True)
class Table:
    """Input rows reduced to what the algorithms need, with lazily built encodings."""

    n: int
    qis: tuple[QuasiIdentifier, ...]
    columns: Mapping[str, Sequence[Any]]
    criteria: CriteriaSet
    max_sup: int
    _encoded: tuple[EncodedHierarchy, ...] | None = field(default=None)
    _axes: tuple[Axis, ...] | None = field(default=None)

    @property
    def qi_columns(self) -> tuple[str, ...]:
        return tuple(c for q in self.qis for c in q.columns)

    def hierarchy(self, i: int) -> Hierarchy:
        qi = self.qis[i]
        cols = [self.columns[c] for c in qi.columns]
        return qi.hierarchy if qi.hierarchy is not None else default_hierarchy(qi.kind, cols, qi.columns)

    def encoded(self) -> tuple[EncodedHierarchy, ...]:
        if self._encoded is None:
            self._encoded = tuple(
                self.hierarchy(i).encode([self.columns[c] for c in q.columns], q.columns)
                for i, q in enumerate(self.qis)
            )
        return self._encoded

    def axes(self) -> tuple[Axis, ...]:
        if self._axes is None:
            axes: list[Axis] = []
            for i, q in enumerate(self.qis):
                if q.kind == "categorical":
                    raw = [str(v) for v in self.columns[q.columns[0]]]
                    bad = sorted({v for v in raw if _SET_CHARS & set(v)})
                    if bad:
                        raise InvalidTableInput(f"column {q.columns[0]!r}: categorical values may not contain |{{}}[]")
                    order: tuple[str, ...]
                    if isinstance(q.hierarchy, CategoricalHierarchy):
                        order = q.hierarchy.leaves
                        unknown = sorted(set(raw) - set(order))
                        if unknown:
                            raise InvalidTableInput(
                                f"column {q.columns[0]!r}: value(s) not in the hierarchy: {unknown[:5]}"
                            )
                    else:
                        order = tuple(sorted(set(raw)))
                    rank = {v: r for r, v in enumerate(order)}
                    vals = np.fromiter((rank[v] for v in raw), dtype=np.float64, count=len(raw))
                    axes.append(Axis(q.columns[0], i, True, True, vals, order))
                else:
                    for c in q.columns:
                        vals = parse_numbers(self.columns[c], c)
                        integral = q.kind == "time" or bool(np.all(vals == np.floor(vals)))
                        axes.append(Axis(c, i, False, integral, vals, ()))
            self._axes = tuple(axes)
        return self._axes


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an algorithm returns: released classes, their written QI cells, suppressed rows, loss inputs.

    ``ncp`` is per class the mean over QIs of one row's NCP; ``levels`` (hierarchy levels per class and QI)
    feeds Prec and WHD and is None for hierarchy-free algorithms; ``modified_cells`` counts released QI cells
    whose written form differs from the original's exact form.
    """

    classes: list[IntArray]
    written: list[dict[str, str]]
    suppressed: IntArray
    ncp: list[float] | None
    levels: list[tuple[int, ...]] | None
    heights: tuple[int, ...] | None
    modified_cells: int
