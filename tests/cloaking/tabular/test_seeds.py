"""Every checkable worked example of CONCEPTS §8 (S000, S001, S003, S004), one test each (§9.10 names)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from kcloak.cloaking.tabular import (
    CategoricalHierarchy,
    GridHierarchy,
    IntervalHierarchy,
    NotApplicable,
    QuasiIdentifier,
    Unsatisfiable,
    anonymize_table,
)
from kcloak.cloaking.tabular.criteria import (
    DistinctLDiversity,
    EntropyLDiversity,
    HierarchicalDistance,
    OrderedDistance,
    RecursiveCLDiversity,
    l_achieved,
)
from kcloak.cloaking.tabular.lattice import LatticeProblem, incognito, ola, samarati
from kcloak.cloaking.tabular.mdav import mdav_groups
from kcloak.cloaking.tabular.metrics import release_metrics, whd
from kcloak.cloaking.tabular.mondrian import Cut, partition
from tests.cloaking.tabular import checker
from tests.cloaking.tabular.seeds import (
    DOB_S001,
    MARITAL,
    RACE,
    S000,
    S001,
    S004,
    S004_QIS,
    SEX,
    ZIP_S001,
    make_table,
)

RACE_ZIP = (
    QuasiIdentifier("race", "categorical", ("race",), RACE),
    QuasiIdentifier("zip", "categorical", ("zip",), ZIP_S001),
)


def _released(rows: list[dict[str, str]], cols: tuple[str, ...]) -> Counter[tuple[str, ...]]:
    return Counter(tuple(r[c] for c in cols) for r in rows)


# --------------------------------------------------------------------------- §8.4, §8.5


def test_kmin_s001() -> None:
    problem = LatticeProblem(make_table(S001, RACE_ZIP, k=2, max_sup=2))
    sup = {v: problem.suppression(v) for h in range(4) for v in problem.vectors_at_height(h)}
    assert sup == {(0, 0): 6, (1, 0): 2, (0, 1): 2, (1, 1): 0, (0, 2): 0, (1, 2): 0}
    assert incognito(problem).minimal == ((0, 1), (1, 0))


def test_kmin_s004() -> None:
    problem = LatticeProblem(make_table(S004, S004_QIS, k=3, max_sup=2))
    expected = {
        (0, 0, 0): 10,
        (1, 0, 0): 7, (0, 1, 0): 10, (0, 0, 1): 10,
        (2, 0, 0): 7, (1, 1, 0): 1, (1, 0, 1): 7, (0, 2, 0): 10, (0, 1, 1): 10,
        (2, 1, 0): 1, (2, 0, 1): 6, (1, 2, 0): 1, (1, 1, 1): 1, (0, 2, 1): 1,
        (2, 2, 0): 0, (2, 1, 1): 0, (1, 2, 1): 0,
        (2, 2, 1): 0,
    }  # fmt: skip
    got = {v: problem.suppression(v) for h in range(6) for v in problem.vectors_at_height(h)}
    assert got == expected
    # the release at [1,1,0] is the §8.4 table (row 10 suppressed)
    out = problem.outcome((1, 1, 0))
    assert [int(r) + 1 for r in out.suppressed] == [10]
    rows = [{**S004[int(i)], **w} for cl, w in zip(out.classes, out.written, strict=True) for i in cl]
    assert _released(rows, ("zip", "marital", "sex", "disease")) == Counter(
        {
            ("2203*", "been married", "F", "hypertension"): 3,
            ("2203*", "never married", "M", "obesity"): 2,
            ("2203*", "never married", "M", "HIV"): 1,
            ("2204*", "been married", "M", "obesity"): 1,
            ("2204*", "been married", "M", "HIV"): 2,
        }
    )


def test_samarati_trace() -> None:
    s001 = samarati(LatticeProblem(make_table(S001, RACE_ZIP, k=2, max_sup=2)))
    assert [h for h, _ in s001.trace] == [1, 0]
    assert set(s001.trace[0][1]) == {(1, 0), (0, 1)} and s001.trace[1][1] == ()
    assert sum(s001.node) == 1
    s004 = samarati(LatticeProblem(make_table(S004, S004_QIS, k=3, max_sup=2)))
    assert s004.trace == ((2, ((1, 1, 0),)), (1, ()))
    assert s004.node == (1, 1, 0)


def test_samarati_end_to_end_maxsup() -> None:
    # max_suppression 0.2 of 10 rows = MaxSup 2: the §8.4 release with one row suppressed
    rel = anonymize_table(
        S004, quasi_identifiers=S004_QIS, sensitive="disease", algorithm="samarati", k=3, max_suppression=0.2, seed=3
    )
    assert rel.suppressed_rows == 1 and rel.classes == 3 and rel.k_achieved == 3
    assert {r["_rid"] for r in rel.rows} == {str(i) for i in range(1, 10)}
    assert {r["zip"] for r in rel.rows} == {"2203*", "2204*"}
    # with MaxSup 0 the lowest height is 4
    rel0 = anonymize_table(
        S004, quasi_identifiers=S004_QIS, sensitive="disease", algorithm="samarati", k=3, max_suppression=0.0, seed=3
    )
    assert rel0.suppressed_rows == 0 and rel0.metrics["prec"] is not None


def test_incognito_trace() -> None:
    problem = LatticeProblem(make_table(S004, S004_QIS, k=3, max_sup=2))
    res = incognito(problem)
    assert len(res.satisfying) == 9
    assert res.minimal == ((0, 2, 1), (1, 1, 0))
    assert res.per_subset[(0,)] == {(0,), (1,), (2,)}
    assert res.per_subset[(1,)] == {(1,), (2,)}
    assert res.per_subset[(2,)] == {(0,), (1,)}
    assert res.checked[(0, 1)] == ((0, 1), (0, 2), (1, 1))  # M0 nodes pruned
    assert res.checked[(0, 2)] == ((0, 0), (0, 1), (1, 0))
    assert res.checked[(1, 2)] == ((1, 0),)
    assert res.checked[(0, 1, 2)] == ((1, 1, 0), (0, 2, 1))
    assert problem.suppression((0,), (0,)) == 1
    assert problem.suppression((0,), (1,)) == 6
    assert problem.suppression((0, 1), (0, 1)) == 10
    assert problem.suppression((0, 2), (0, 1)) == 1


def test_ola_s004() -> None:
    problem = LatticeProblem(make_table(S004, S004_QIS, k=3, max_sup=2))
    res = ola(problem, "prec")
    assert res.k_minimal == ((0, 2, 1), (1, 1, 0))
    assert res.node == (1, 1, 0)
    assert problem.prec_loss((1, 1, 0)) == pytest.approx(1 / 3)
    assert problem.prec_loss((0, 2, 1)) == pytest.approx(2 / 3)
    assert problem.dm((1, 1, 0)) == problem.dm((0, 2, 1)) == 37
    assert ola(LatticeProblem(make_table(S004, S004_QIS, k=3, max_sup=2)), "discernibility").node == (1, 1, 0)
    assert res.evaluations < 18  # predictive tagging skips nodes


def test_taxonomy_fig9_ag_ts() -> None:
    qis = (
        QuasiIdentifier("race", "categorical", ("race",), RACE),
        QuasiIdentifier("dob", "categorical", ("dob",), DOB_S001),
        QuasiIdentifier("sex", "categorical", ("sex",), SEX),
        QuasiIdentifier("zip", "categorical", ("zip",), ZIP_S001),
    )
    problem = LatticeProblem(make_table(S001, qis, k=2, max_sup=1))
    out = problem.outcome((0, 1, 0, 2))  # column (b): race, yy/mm, sex, 941**
    assert [int(r) + 1 for r in out.suppressed] == [2]
    got = {S001[int(i)]["_rid"]: tuple(w.values()) for cl, w in zip(out.classes, out.written, strict=True) for i in cl}
    assert got == {
        "1": ("asian", "64/04", "F", "941**"),
        "3": ("asian", "64/04", "F", "941**"),
        "4": ("asian", "63/03", "M", "941**"),
        "5": ("asian", "63/03", "M", "941**"),
        "6": ("black", "64/09", "F", "941**"),
        "7": ("black", "64/09", "F", "941**"),
        "8": ("white", "64/09", "F", "941**"),
        "9": ("white", "64/09", "F", "941**"),
    }
    # (f) _TS: all nine QI tuples are distinct, so the bottom node suppresses everything
    assert problem.suppression((0, 0, 0, 0)) == 9


# --------------------------------------------------------------------------- §8.9 Mondrian


def test_mondrian_s000() -> None:
    qis = (
        QuasiIdentifier("zip", "categorical", ("zip",)),
        QuasiIdentifier("age", "numeric", ("age",)),
    )
    trace: list[Cut] = []
    classes = partition(make_table(S000, qis, k=2, max_sup=0), relaxed=False, trace=trace)
    assert trace == [
        Cut(9, "zip", 4.0, 5, 4),  # rank 4 of the sorted ZIPs = 99334
        Cut(5, "age", 40.0, 3, 2),
        Cut(4, "age", 50.0, 2, 2),
    ]
    groups = {frozenset(int(i) + 1 for i in c) for c in classes}
    assert groups == {frozenset({1, 3, 6}), frozenset({7, 9}), frozenset({2, 4}), frozenset({5, 8})}
    rel = anonymize_table(S000, quasi_identifiers=qis, sensitive=None, algorithm="mondrian", k=2, seed=1)
    by_rid = {r["_rid"]: (r["age"], r["zip"]) for r in rel.rows}
    assert by_rid["1"] == ("[30,40]", "{98512|98545|98578}")
    assert by_rid["7"] == ("[55,65]", "{99301|99334}")
    assert by_rid["2"] == ("[45,50]", "{99356|99413}")
    assert by_rid["5"] == ("[60,70]", "{99423|99490}")
    assert rel.k_achieved == 2 and rel.classes == 4 and rel.suppressed_rows == 0


def test_mondrian_s004() -> None:
    sex = CategoricalHierarchy({"M": ("*",), "F": ("*",)})
    marital = CategoricalHierarchy({m: ("*",) for m in ("married", "widow", "divorced", "single")})
    qis = (
        QuasiIdentifier("sex", "categorical", ("sex",), sex),
        QuasiIdentifier("marital", "categorical", ("marital",), marital),
    )
    rel = anonymize_table(S004, quasi_identifiers=qis, sensitive=None, algorithm="mondrian", k=2, seed=5)
    classes: dict[tuple[str, str], set[int]] = {}
    for r in rel.rows:
        classes.setdefault((r["marital"], r["sex"]), set()).add(int(r["_rid"]))
    assert classes == {
        ("married", "F"): {1, 2},
        ("single", "M"): {3, 4, 5},
        ("{divorced|single}", "F"): {6, 10},
        ("{divorced|widow}", "M"): {7, 8, 9},
    }


# --------------------------------------------------------------------------- §8.10 MDAV


def test_mdav_age() -> None:
    rel = anonymize_table(
        S000,
        quasi_identifiers=(QuasiIdentifier("age", "numeric", ("age",)),),
        sensitive="disease",
        algorithm="mdav",
        k=3,
        seed=2,
    )
    by_age: dict[int, list[str]] = {int(r["age"]): [] for r in rel.rows}
    for r in rel.rows:
        by_age[int(r["age"])].append(r["disease"])
    assert {a: sorted(d) for a, d in by_age.items()} == {
        35: ["Cardiomyopathy", "Heart attack", "Pericarditis"],
        50: ["COVID-19", "COVID-19", "COVID-19"],
        65: ["Cough", "Dermatitis", "Short breath"],
    }
    assert rel.l_achieved == 1.0  # the homogeneous 50-group
    x = np.asarray([[float(str(r["age"]))] for r in S000])
    assert sorted(sorted(int(x[i, 0]) for i in g) for g in mdav_groups((x - x.mean()) / x.std(), 3)) == [
        [30, 35, 40],
        [45, 50, 55],
        [60, 65, 70],
    ]
    # with distinct 2-diversity the homogeneous group is merged away
    rel2 = anonymize_table(
        S000,
        quasi_identifiers=(QuasiIdentifier("age", "numeric", ("age",)),),
        sensitive="disease",
        algorithm="mdav",
        k=3,
        l=2,
        seed=2,
    )
    assert rel2.l_achieved is not None and rel2.l_achieved >= 2


def test_mdav_categorical_not_applicable() -> None:
    with pytest.raises(NotApplicable):
        anonymize_table(S004, quasi_identifiers=S004_QIS, sensitive=None, algorithm="mdav", k=2)


# --------------------------------------------------------------------------- §8.12 ℓ-diversity


def _counts(classes: list[list[str]]) -> np.ndarray:
    domain = sorted({v for c in classes for v in c})
    return np.asarray([[c.count(d) for d in domain] for c in classes], dtype=np.int64)


def test_ldiv_seeds() -> None:
    fig18 = [["hypertension"] * 3, ["obesity", "HIV", "obesity"], ["obesity", "HIV", "HIV"]]
    counts = _counts(fig18)
    sizes = counts.sum(axis=1)
    assert DistinctLDiversity(2).accepts(sizes, counts).tolist() == [False, True, True]
    assert l_achieved(counts, "distinct", None) == 1
    assert math.exp(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3)) == pytest.approx(
        checker.entropy_l(fig18[1])
    )
    assert checker.entropy_l(fig18[1]) == pytest.approx(1.8899, abs=1e-4)
    assert EntropyLDiversity(2).accepts(sizes, counts).tolist() == [False, False, False]
    assert RecursiveCLDiversity(2.0, 2).accepts(sizes, counts).tolist() == [False, False, False]
    assert RecursiveCLDiversity(2.01, 2).accepts(sizes, counts).tolist() == [False, True, True]
    for c in (2.0, 2.01):
        assert [checker.recursive_ok(v, c, 2) for v in fig18] == RecursiveCLDiversity(c, 2).accepts(
            sizes, counts
        ).tolist()
    fig4 = [
        ["Heart attack", "Cardiomyopathy", "Pericarditis"],
        ["COVID-19", "Dermatitis", "Cough"],
        ["Short breath", "COVID-19", "COVID-19"],
    ]
    c4 = _counts(fig4)
    assert l_achieved(c4, "distinct", None) == 2
    assert l_achieved(c4, "entropy", None) == pytest.approx(1.8899, abs=1e-4)
    s003_t4 = [["Cancer"] * 4, ["Viral Infection", "Heart disease", "Viral Infection", "Viral Infection"]]
    assert l_achieved(_counts(s003_t4), "distinct", None) == 1


# --------------------------------------------------------------------------- §8.13 Anatomy


def test_anatomy_fig8_properties() -> None:
    rows = [
        {"_rid": str(i), "dob": d, "sex": s, "zip": z, "disease": v}
        for i, (d, s, z, v) in enumerate(
            [
                ("1940/08/10", "F", "98512", "Heart attack"),
                ("1950/02/12", "M", "99413", "COVID-19"),
                ("1940/08/04", "F", "98578", "Cardiomyopathy"),
                ("1950/02/13", "M", "99356", "COVID-19"),
                ("1950/07/12", "M", "99423", "Dermatitis"),
                ("1940/08/11", "F", "98545", "Pericarditis"),
                ("1950/07/25", "M", "99334", "Short breath"),
                ("1950/07/30", "M", "99490", "Cough"),
                ("1950/02/20", "M", "99301", "COVID-19"),
            ]
        )
    ]
    qis = tuple(QuasiIdentifier(c, "categorical", (c,)) for c in ("dob", "sex", "zip"))
    rel = anonymize_table(rows, quasi_identifiers=qis, sensitive="disease", algorithm="anatomy", k=3, l=2, seed=7)
    assert rel.sensitive_table is not None
    assert all("disease" not in r and "group_id" in r for r in rel.rows)
    originals = {r["_rid"]: r for r in rows}
    for r in rel.rows:  # QIs released exactly
        assert all(r[c] == originals[r["_rid"]][c] for c in ("dob", "sex", "zip"))
    # join QIT and ST by group id: the multiset of (gid, disease) pairs is reproduced
    truth = Counter((r["group_id"], originals[r["_rid"]]["disease"]) for r in rel.rows)
    st = Counter({(str(s["group_id"]), str(s["disease"])): int(s["count"]) for s in rel.sensitive_table})
    assert truth == st
    groups = Counter(r["group_id"] for r in rel.rows)
    assert min(groups.values()) >= 3 and rel.k_achieved >= 3
    for g in groups:
        assert len({d for (gid, d) in st if gid == g}) >= 2
    assert rel.l_achieved is not None and rel.l_achieved >= 2
    assert rel.metrics["modification_rate"] == 0.0


def test_anatomy_ineligible_and_not_applicable() -> None:
    rows = [{"a": str(i), "s": "x" if i < 8 else "y"} for i in range(10)]
    qis = (QuasiIdentifier("a", "categorical", ("a",)),)
    with pytest.raises(Unsatisfiable):
        anonymize_table(rows, quasi_identifiers=qis, sensitive="s", algorithm="anatomy", k=1, l=2)
    with pytest.raises(NotApplicable):
        anonymize_table(rows, quasi_identifiers=qis, sensitive="s", algorithm="anatomy", k=1)
    with pytest.raises(NotApplicable):
        anonymize_table(rows, quasi_identifiers=qis, sensitive=None, algorithm="anatomy", k=1, l=2)


# --------------------------------------------------------------------------- §8.14 t-closeness


def _emd_ordered(cls: list[float], domain: list[float], population: list[float]) -> float:
    p = np.asarray([[cls.count(d) / len(cls) for d in domain]])
    q = np.asarray([[population.count(d) / len(population) for d in domain]])
    return float(OrderedDistance().emd(p, q)[0])


def test_emd_examples() -> None:
    salary = [float(x) for x in range(3, 12)]
    for cls, want in (([3, 4, 5], 0.375), ([6, 8, 11], 0.1667), ([3, 5, 9], 0.1667), ([4, 7, 10], 0.0833)):
        got = _emd_ordered([float(c) for c in cls], salary, salary)
        assert got == pytest.approx(want, abs=1e-4)
        p = [cls.count(int(d)) / 3 for d in salary]
        assert checker.emd_lp(p, [1 / 9] * 9, checker.ordered_ground(salary)) == pytest.approx(got, abs=1e-9)
    chol_domain = [190.0, 210, 220, 230, 250, 260, 275, 285]
    population = [230.0, 220, 250, 260, 250, 275, 285, 210, 190]
    for chol, want in (([230.0, 220, 275], 0.1111), ([250.0, 260, 250], 0.2063), ([285.0, 210, 190], 0.2222)):
        assert _emd_ordered(chol, chol_domain, population) == pytest.approx(want, abs=1e-4)
    flat = HierarchicalDistance.from_hierarchy(CategoricalHierarchy.flat(["N", "Y"]), ("N", "Y"))
    q = np.asarray([[6 / 9, 3 / 9]])
    for dist, want in (([1.0, 0.0], 1 / 3), ([1 / 3, 2 / 3], 1 / 3), ([2 / 3, 1 / 3], 0.0)):
        assert float(flat.emd(np.asarray([dist]), q)[0]) == pytest.approx(want)
    diseases = {
        "flu": ("respiratory", "*"),
        "pneumonia": ("respiratory", "*"),
        "bronchitis": ("respiratory", "*"),
        "gastritis": ("digestive", "*"),
        "gastric ulcer": ("digestive", "*"),
        "stomach cancer": ("digestive", "*"),
    }
    tree = CategoricalHierarchy(diseases)
    domain = tree.leaves
    hd = HierarchicalDistance.from_hierarchy(tree, domain)
    uniform = np.full((1, 6), 1 / 6)
    ground = checker.tree_ground(domain, diseases)
    for members, want in ((("flu", "pneumonia", "bronchitis"), 0.5), (("flu", "pneumonia", "gastritis"), 1 / 3)):
        pm = np.asarray([[1 / 3 if d in members else 0.0 for d in domain]])
        assert float(hd.emd(pm, uniform)[0]) == pytest.approx(want)
        assert checker.emd_lp(pm[0].tolist(), uniform[0].tolist(), ground) == pytest.approx(want, abs=1e-9)


def test_t_closeness_fig19_release() -> None:
    rows = [{**r, "chol": c} for r, c in zip(S004[:9], [230, 220, 250, 260, 250, 275, 285, 210, 190], strict=True)]
    rel = anonymize_table(
        rows, quasi_identifiers=S004_QIS, sensitive="chol", algorithm="samarati", k=3, max_suppression=0.0, seed=1
    )
    cls = checker.group(rel.rows, ("zip", "marital", "sex"), "chol")
    domain = sorted({r["chol"] for r in rel.rows}, key=float)
    want = checker.max_emd(cls, domain, checker.ordered_ground([float(d) for d in domain]))
    assert rel.t_achieved == pytest.approx(want, abs=1e-9)
    strict = anonymize_table(
        rows, quasi_identifiers=S004_QIS, sensitive="chol", algorithm="ola", k=3, t=0.15, max_suppression=0.0
    )
    assert strict.t_achieved is not None and strict.t_achieved <= 0.15 + 1e-9


# --------------------------------------------------------------------------- §8.16 metrics


def test_whd_s003() -> None:
    assert whd(3, 5, beta=0.0) == pytest.approx(0.6)
    assert whd(3, 5, beta=1.0) == pytest.approx(0.3431, abs=1e-4)
    assert whd(1, 1, beta=0.0) == whd(1, 1, beta=1.0) == 1.0
    assert 5 * whd(3, 5, beta=0.0) == pytest.approx(3 * whd(1, 1))


def test_modrate_s003() -> None:
    rows = [
        {"_rid": str(i), "gender": g, "birthday": b, "problem": p}
        for i, (g, b, p) in enumerate(
            [
                ("male", "13.08.1962", "stress"),
                ("male", "28.10.1967", "obesity"),
                ("male", "20.01.1977", "stress"),
                ("female", "15.09.1973", "obesity"),
                ("female", "15.03.1985", "stress"),
                ("female", "28.05.1986", "obesity"),
            ]
        )
    ]
    birthday = CategoricalHierarchy({r["birthday"]: (r["birthday"][6:9] + "*", "*") for r in rows}, written="label")
    gender = CategoricalHierarchy({"male": ("*",), "female": ("*",)})
    qis = (
        QuasiIdentifier("gender", "categorical", ("gender",), gender),
        QuasiIdentifier("birthday", "categorical", ("birthday",), birthday),
    )
    out = LatticeProblem(make_table(rows, qis, k=2, max_sup=0)).outcome((1, 1))  # table (c)
    assert sorted(tuple(w.values()) for cl, w in zip(out.classes, out.written, strict=True) for _ in cl) == sorted(
        [("*", "196*")] * 2 + [("*", "197*")] * 2 + [("*", "198*")] * 2
    )
    assert release_metrics(out, 6, 2, 2)["modification_rate"] == 1.0  # 12/12
    rel = anonymize_table(rows, quasi_identifiers=qis, sensitive="problem", algorithm="samarati", k=2, seed=0)
    assert rel.k_achieved == 3 and rel.metrics["modification_rate"] == pytest.approx(0.5)  # node [0,2]
    local = [("male", "13.08.1962"), ("male", "28.10.1967"), ("*", "197*"), ("*", "197*")]
    local += [("female", "15.03.1985"), ("female", "28.05.1986")]
    changed = sum(a != r["gender"] for (a, _), r in zip(local, rows, strict=True))
    changed += sum(b != r["birthday"] for (_, b), r in zip(local, rows, strict=True))
    assert changed / 12 == pytest.approx(1 / 3)  # table (b): 4/12
    table_b = [{"gender": g, "birthday": b, "v": "x"} for g, b in local]
    assert min(checker.group(table_b, ("gender", "birthday"), "v").sizes) == 1  # (b) is not 2-anonymous


# --------------------------------------------------------------------------- hierarchies


def test_hierarchy_written_forms() -> None:
    enc = IntervalHierarchy.time().encode([[1714551234, 1714554000]], ["t"])
    assert enc.height == 6
    assert enc.write(1, 0) == ("[1714551180,1714551240)",)
    assert enc.write(3, 0) == ("[1714550400,1714554000)",)
    assert enc.write(3, 1) == ("[1714554000,1714557600)",)
    assert enc.write(5, 0) == ("[1714348800,1714953600)",)  # ISO week starting Monday 2024-04-29
    assert enc.write(6, 0) == ("*",)
    geo = GridHierarchy.geohash(7).encode([[39.9042], [116.4074]], ["lat", "lon"])
    lat_s, lon_s = geo.write(3, 0)  # geohash length 5
    assert checker.satisfies(lat_s, "39.9042") and checker.satisfies(lon_s, "116.4074")
    lo, hi = (float(x) for x in lat_s[1:-1].split(","))
    assert hi - lo == pytest.approx(180 / 2**12)
    quad = GridHierarchy.quadtree(39.0, 41.0, 115.0, 117.0, 4).encode([[41.0], [117.0]], ["lat", "lon"])
    assert quad.write(1, 0) == ("[40.875,41]", "[116.875,117]")  # closed on the box's upper edge
    assert MARITAL.write_node(1, "widow") == "been married"
    assert CategoricalHierarchy(dict(MARITAL.paths)).write_node(1, "widow") == "{divorced|married|widow}"
    numeric = IntervalHierarchy.from_data(np.asarray([39.9, 39.95, 40.0]))
    enc2 = numeric.encode([[39.9, 39.95, 40.0]], ["lat"])
    for level in range(1, enc2.height):
        for row, v in enumerate(("39.9", "39.95", "40")):
            assert checker.satisfies(enc2.write(level, row)[0], v)
