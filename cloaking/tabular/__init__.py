"""Tabular release: generalization algorithms, privacy criteria and loss metrics (CONCEPTS §8, contract §8).

One entry point, :func:`anonymize_table`, runs any algorithm of :data:`ALGORITHMS` under any combination of
k-anonymity, ℓ-diversity (distinct, entropy, recursive (c, ℓ)) and t-closeness, and returns a
:class:`TabularRelease` of written forms in random order.
"""

from __future__ import annotations

from kcloak.cloaking.tabular._errors import InvalidTableInput, NotApplicable, TabularError, Unsatisfiable
from kcloak.cloaking.tabular._release import ALGORITHMS, TabularRelease, anonymize_table
from kcloak.cloaking.tabular._table import QuasiIdentifier
from kcloak.cloaking.tabular.hierarchy import (
    CategoricalHierarchy,
    GridHierarchy,
    Hierarchy,
    IntervalHierarchy,
    PrefixHierarchy,
)

__all__ = [
    "ALGORITHMS",
    "CategoricalHierarchy",
    "GridHierarchy",
    "Hierarchy",
    "IntervalHierarchy",
    "InvalidTableInput",
    "NotApplicable",
    "PrefixHierarchy",
    "QuasiIdentifier",
    "TabularError",
    "TabularRelease",
    "Unsatisfiable",
    "anonymize_table",
]
