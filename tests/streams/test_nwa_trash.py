"""NWA's trash accounting (issue 16 §1): the bound is over the whole input, never a budget to spend.

The synthetic hour (:func:`kcloak.streams.synthetic.cab_hour_fixes`) is shaped like the issue's real hour
of 436 San Francisco cabs: most report all hour, the others join or leave on whole minutes, and 103 sit
in time-span classes smaller than k = 5. Before the fix NWA spent ``floor(trash_max·|class|)`` inside
every class on top of those 103, so raising ``--trash-max`` raised the trash and no bound published.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcloak.cli.main import main
from kcloak.core.geometry import Aeqd
from kcloak.core.readers import read_fixes, write_contract_csv
from kcloak.streams.kdelta import trash_limit
from kcloak.streams.kdelta.nwa import nwa
from kcloak.streams.publish import anonymize, refusal_reason
from kcloak.streams.quality import verify_k_delta
from kcloak.streams.synthetic import cab_hour_fixes
from kcloak.streams.trajectory import Trajectory, split_too_short, trajectories_from_fixes

FRAME = Aeqd(37.77, -122.42)
TDRIVE = (
    Path(__file__).resolve().parents[3] / "shared" / "data" / "research" / "tdrive_beijing_20080202_1600-1630.csv.gz"
)


def cab_hour() -> list[Trajectory]:
    trajs, _ = split_too_short(trajectories_from_fixes(cab_hour_fixes()))
    return trajs


def unavoidable(trajs: list[Trajectory], k: int, pi_s: float = 60.0) -> int:
    """Trajectories NWA cannot publish whatever its radius: empty trimmed spans and classes below k (own count)."""
    sizes: dict[tuple[float, float], int] = {}
    short = 0
    for tr in trajs:
        a, b = math.ceil(tr.t_start / pi_s) * pi_s, math.floor(tr.t_end / pi_s) * pi_s
        if a >= b:
            short += 1
        else:
            sizes[(a, b)] = sizes.get((a, b), 0) + 1
    return short + sum(n for n in sizes.values() if n < k)


def test_cab_hour_trash_is_the_unavoidable_part_at_every_bound() -> None:
    trajs = cab_hour()
    assert len(trajs) == 436
    forced = unavoidable(trajs, 5)
    assert forced == 103
    got = {tm: nwa(trajs, k=5, delta_m=2_000.0, trash_max=tm) for tm in (0.1, 0.3, 0.5)}
    for tm, r in got.items():
        assert len(r.trash) == forced, tm  # before: 103, 191, 261 (more trash at a looser bound)
        assert r.ok == (forced <= trash_limit(436, tm))
    assert not got[0.1].ok and got[0.3].ok and got[0.5].ok
    assert len(got[0.3].published) == 436 - forced
    assert got[0.3].trash_by_reason() == {"class_smaller_than_k": forced}
    sizes = sorted(c.n for c in got[0.3].small_classes)
    assert sum(sizes) == forced and max(sizes) < 5


def test_refusal_names_the_small_classes_and_the_methods_that_accept_them() -> None:
    release = anonymize(cab_hour_fixes(), method="nwa", k=5, delta_m=2_000.0, trash_max=0.1, seed=1, range_queries=0)
    assert not release.ok and len(release.table) == 0
    rep = release.report
    assert rep["n_trash"] == 103 and rep["trash_limit"] == 43
    sizes = {int(n): c for n, c in rep["small_class_sizes"].items()}
    assert sum(n * c for n, c in sizes.items()) == 103 and max(sizes) < 5
    text = refusal_reason(rep)
    assert "103 in time-span classes smaller than k=5" in text
    assert f"{sum(sizes.values())} time-span classes too small" in text
    assert "--method w4m" in text and "--pi-s" in text
    assert "cab" not in text  # no input id in a text that may be logged


def test_cli_refuses_with_the_reason_then_publishes_at_a_bound_that_holds_the_unavoidable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, out, rep = tmp_path / "hour.csv", tmp_path / "out.csv", tmp_path / "rep.json"
    write_contract_csv(src, cab_hour_fixes())
    args = ["anonymize", str(src), "-o", str(out), "--k", "5", "--delta", "2000", "--report", str(rep)]
    assert main([*args, "--trash-max", "0.1"]) == 1
    err = capsys.readouterr().err
    assert "classes smaller than k=5" in err and "nothing written" in err
    assert "--method microagg would publish 436 of 436" in err  # the other methods were tried
    assert "too small for k (span, trajectories):" in err and "2008-05-17 10:" in err and "… and 42 more" in err
    assert not out.exists()
    assert main([*args, "--trash-max", "0.3", "--no-suggest"]) == 0
    err = capsys.readouterr().err
    report = json.loads(rep.read_text())
    # outliers joined groups (some cabs wander 20 km off): the release says so and names the remedy
    assert report["translation_m"]["max"] > 20_000.0
    assert "warning: some published points moved more than 10×delta" in err and "--max-radius" in err
    assert main([*args, "--trash-max", "0.3", "--no-suggest", "--max-radius", "15000"]) == 0
    bounded = json.loads(rep.read_text())
    assert bounded["trash_reasons"].get("beyond_radius", 0) > 0 and bounded["n_trash"] > 103
    assert bounded["translation_m"]["max"] < report["translation_m"]["max"]
    assert "warning" not in capsys.readouterr().err or bounded["translation_m"]["max"] > 20_000.0
    assert main([*args, "--trash-max", "0.3", "--no-suggest"]) == 0
    report = json.loads(rep.read_text())
    assert report["n_out"] == 333 and report["n_trash"] == 103
    assert set(report["translation_m"]) == {"median", "p95", "max"}
    assert report["translation_m"]["median"] <= report["translation_m"]["p95"] <= report["translation_m"]["max"]
    assert verify_k_delta(read_fixes(out), 5, 2_000.0).ok


@st.composite
def uneven_scenes(draw: st.DrawFn) -> tuple[list[Trajectory], int, float | None]:
    """Classes of unequal spans and sizes (some below k), with an outlier now and then."""
    k = draw(st.integers(2, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    trajs: list[Trajectory] = []
    for c in range(draw(st.integers(1, 5))):
        a = 60.0 * draw(st.integers(0, 5))
        b = a + 60.0 * draw(st.integers(1, 6))
        t = np.arange(a, b + 1.0, 60.0) + 600.0
        for _ in range(draw(st.integers(1, 7))):
            spread = 40_000.0 if rng.random() < 0.15 else 800.0
            x, y = rng.normal(size=(2, len(t))) * spread
            trajs.append(Trajectory.of(f"c{c}-{len(trajs)}", t, *FRAME.inverse(x, y)))
    radius = draw(st.sampled_from([None, 500.0, 5_000.0, 50_000.0]))
    return trajs, k, radius


@settings(max_examples=80, deadline=None)
@given(uneven_scenes(), st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0]), min_size=2, max_size=4))
def test_trash_is_non_increasing_in_trash_max(
    scene: tuple[list[Trajectory], int, float | None], bounds: list[float]
) -> None:
    trajs, k, radius = scene
    prev: tuple[int, bool] | None = None
    for tm in sorted(bounds):
        r = nwa(trajs, k=k, delta_m=300.0, trash_max=tm, max_radius=radius)
        n = len(r.trash)
        if prev is not None:
            assert n <= prev[0]  # a looser bound never trashes more …
            assert r.ok or not prev[1]  # … and never refuses what a tighter one published
        prev = (n, r.ok)
        assert sum(c for _, c in r.trash_reasons) == n
        assert n >= unavoidable(trajs, k)


def test_tdrive_half_hour_trash_does_not_grow_with_the_bound() -> None:
    """The real T-Drive sample (8,210 Beijing taxis, half an hour), read in place."""
    if not TDRIVE.exists():
        pytest.skip(f"research T-Drive sample absent at {TDRIVE}")
    fixes = read_fixes(TDRIVE)
    trajs, _ = split_too_short(trajectories_from_fixes(fixes))
    forced = unavoidable(trajs, 5)
    trash = []
    for tm in (0.1, 0.3):
        release = anonymize(fixes, method="nwa", k=5, delta_m=2_000.0, trash_max=tm, seed=1, range_queries=0)
        rep = release.report
        trash.append(rep["n_trash"])
        assert rep["n_trash"] == forced
        assert release.ok == (forced <= rep["trash_limit"])
        if release.ok:
            assert verify_k_delta(release.table, 5, 2_000.0, certify=False).ok
    assert trash[1] <= trash[0]
