"""Seed tables and hierarchies of CONCEPTS §8 (S000, S001, S003, S004), as given there."""

from __future__ import annotations

from typing import Any

from kcloak.cloaking.tabular import CategoricalHierarchy, PrefixHierarchy, QuasiIdentifier
from kcloak.cloaking.tabular._table import Table
from kcloak.cloaking.tabular.criteria import LKind, SensitiveColumn, build_criteria

# S001 Fig. 1 (CONCEPTS §8.3): Race, DOB, Sex, ZIP, Marital status, Disease
S001_ROWS = [
    ("asian", "64/04/12", "F", "94142", "divorced", "hypertension"),
    ("asian", "64/09/13", "F", "94141", "divorced", "obesity"),
    ("asian", "64/04/15", "F", "94139", "married", "chest pain"),
    ("asian", "63/03/13", "M", "94139", "married", "obesity"),
    ("asian", "63/03/18", "M", "94139", "married", "short breath"),
    ("black", "64/09/27", "F", "94138", "single", "short breath"),
    ("black", "64/09/27", "F", "94139", "single", "obesity"),
    ("white", "64/09/27", "F", "94139", "single", "chest pain"),
    ("white", "64/09/27", "F", "94141", "widow", "short breath"),
]
S001 = [
    {"_rid": str(i + 1), **dict(zip(("race", "dob", "sex", "zip", "marital", "disease"), r, strict=True))}
    for i, r in enumerate(S001_ROWS)
]
RACE = CategoricalHierarchy({v: ("person",) for v in ("asian", "black", "white")}, written="label")
ZIP_S001 = PrefixHierarchy((1, 2), pad=True, suppress_top=False)
DOB_S001 = CategoricalHierarchy(
    {d: (d[:5], d[:2], "60-65" if int(d[:2]) < 65 else "65-70") for d in sorted({r[1] for r in S001_ROWS})},
    written="label",
)
SEX = CategoricalHierarchy({"M": ("*",), "F": ("*",)})

# S004 Fig. 1 (CONCEPTS §8.4 example 2): ZIP, MaritalStatus, Sex, Disease
S004_ROWS = [
    ("22030", "married", "F", "hypertension"),
    ("22030", "married", "F", "hypertension"),
    ("22030", "single", "M", "obesity"),
    ("22032", "single", "M", "HIV"),
    ("22032", "single", "M", "obesity"),
    ("22032", "divorced", "F", "hypertension"),
    ("22045", "divorced", "M", "obesity"),
    ("22047", "widow", "M", "HIV"),
    ("22047", "widow", "M", "HIV"),
    ("22047", "single", "F", "obesity"),
]
S004 = [
    {"_rid": str(i + 1), **dict(zip(("zip", "marital", "sex", "disease"), r, strict=True))}
    for i, r in enumerate(S004_ROWS)
]
ZIP_S004 = PrefixHierarchy((1, 2), pad=True, suppress_top=False)
MARITAL = CategoricalHierarchy(
    {
        "married": ("been married", "*"),
        "widow": ("been married", "*"),
        "divorced": ("been married", "*"),
        "single": ("never married", "*"),
    },
    written="label",
)
SEX_MF = CategoricalHierarchy({"M": ("*",), "F": ("*",)}, written="label")
S004_QIS = (
    QuasiIdentifier("zip", "categorical", ("zip",), ZIP_S004),
    QuasiIdentifier("marital", "categorical", ("marital",), MARITAL),
    QuasiIdentifier("sex", "categorical", ("sex",), SEX_MF),
)

# S000 (CONCEPTS §8.9 example 1 and §8.10): Age, ZIP, Disease
S000_ROWS = [
    (35, "98512", "Heart attack"),
    (45, "99413", "COVID-19"),
    (30, "98578", "Cardiomyopathy"),
    (50, "99356", "COVID-19"),
    (60, "99423", "Dermatitis"),
    (40, "98545", "Pericarditis"),
    (65, "99334", "Short breath"),
    (70, "99490", "Cough"),
    (55, "99301", "COVID-19"),
]
S000 = [{"_rid": str(i + 1), "age": a, "zip": z, "disease": d} for i, (a, z, d) in enumerate(S000_ROWS)]


def make_table(
    rows: list[dict[str, Any]],
    qis: tuple[QuasiIdentifier, ...],
    *,
    k: int,
    max_sup: int,
    sensitive: str | None = None,
    l: int | None = None,  # noqa: E741
    l_kind: LKind = "distinct",
    c: float | None = None,
    t: float | None = None,
) -> Table:
    """A :class:`Table` with an exact MaxSup (the seeds state MaxSup as a row count)."""
    cols = {c_: [r[c_] for r in rows] for q in qis for c_ in q.columns}
    sens = None
    if sensitive is not None:
        cols[sensitive] = [r[sensitive] for r in rows]
        sens = SensitiveColumn.build(sensitive, cols[sensitive])
    crit = build_criteria(k=k, l=l, l_kind=l_kind, c=c, t=t, sensitive=sens)
    return Table(len(rows), qis, cols, crit, max_sup)
