"""Entropy ℓ is exact where it is an integer, and the release summary prints a verdict (issue 16 §3)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cli.release import l_verdict
from kcloak.cloaking.tabular.criteria import EntropyLDiversity, l_achieved


def test_equal_classes_reach_exactly_their_number_of_values() -> None:
    assert l_achieved(np.array([[4, 4, 4]]), "entropy", None) == 3
    assert l_achieved(np.array([[4, 4, 4, 0], [5, 5, 5, 5]]), "entropy", None) == 3
    assert l_achieved(np.array([[1] * 7]), "entropy", None) == 7


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 1000), st.integers(0, 5))
def test_any_equal_split_is_an_exact_integer(m: int, c: int, zeros: int) -> None:
    counts = np.array([[c] * m + [0] * zeros])
    got = l_achieved(counts, "entropy", None)
    assert got == m and float(got).is_integer()
    assert bool(EntropyLDiversity(float(m)).accepts(counts.sum(axis=1), counts)[0])


def test_unequal_classes_keep_the_entropy_value() -> None:
    counts = np.array([[3, 1]])
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert l_achieved(counts, "entropy", None) == math.exp(h)


def test_summary_line_prints_a_verdict_not_float_noise() -> None:
    line = l_verdict("entropy", 3, l_achieved(np.array([[4, 4, 4]]), "entropy", None))
    assert line == "entropy l-diversity: required 3, every class reaches 3: met"
    assert "NOT met" in l_verdict("entropy", 3, 1.7548)
    assert "1.755" in l_verdict("entropy", 3, 1.7548)
