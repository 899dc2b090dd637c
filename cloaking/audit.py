"""``kcloak audit cloaking``: what an attacker learns from forwarded regions (CONCEPTS §6, §6.8; contract §9).

A run builds a :class:`~kcloak.cloaking.attacks.World` — a synthetic clustered city that moves over
``snapshots`` frames, or successive snapshots of a real trace — gives every user the profile
``k`` of the row, lets each algorithm cloak a request of *every* present user at every frame
(what a K1 + K2 attacker can recompute, §1.5), and runs every attack of §6 on a seeded sample of
``queries`` requests (continuous queries for the tracking attacks). Each row reports the
success rate next to the 1/k baseline and a tolerance derived from the number of trials
(:func:`~kcloak.cloaking.attacks.base.tolerance`). Pure: no I/O (the CLI reads files, writes reports).

Background knowledge of the scenario:

* synthetic world: homes are drawn by the generator from the same clustered distribution as the
  positions; a share of the users stands at home, another at a place of the bundled Beijing
  POIs chosen by a log-normal popularity (a few places draw crowds, so homogeneity can happen);
  the others move at 0.5–12 m/s with a slowly turning heading; everyone is present at every
  frame;
* trace: frame ``f`` at instant ``T_f`` holds the latest fix of each trajectory within
  ``[T_f − W, T_f]`` (the snapshot rule of ``bench cloak``); a user's home is its night-time
  (00–06 local solar time) stay point, or — when the trace has no night stay — its longest stay
  point (radius 200 m, at least 20 min, contract §9 ``release`` defaults); users without a stay
  point have no known home. Places are the bundled POIs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.cloaking.attacks import (
    AttackName,
    BoundaryGuess,
    CentreGuess,
    CloakedWorld,
    CloakingAttack,
    Forwarded,
    Homogeneity,
    ObservationIdentification,
    QueryTrackingNaive,
    QueryTrackingSession,
    RestrictedSpaceIdentification,
    Risk,
    Target,
    World,
)
from kcloak.cloaking.attacks.base import Session
from kcloak.cloaking.bench import SYNTHETIC_NOW, NullProgress, Progress, auto_window_s, clustered_population, user_ids
from kcloak.cloaking.cloakers import SPATIAL_ALGORITHMS, get_cloaker
from kcloak.cloaking.errors import CloakingError
from kcloak.cloaking.index import IndexView
from kcloak.core.errors import InputError
from kcloak.core.extras import require_pictures
from kcloak.core.geometry import EARTH_RADIUS_M, BBox
from kcloak.core.places import PlacesLayer
from kcloak.core.profile import PrivacyProfile, ProfileArrays
from kcloak.core.readers import FixTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
M_PER_DEG = EARTH_RADIUS_M * math.pi / 180.0

ATTACKS: tuple[AttackName, ...] = tuple(AttackName)
DEFAULT_KS: tuple[int, ...] = (5, 10, 20)
DEFAULT_SYNTHETIC_USERS = 3000
CLIQUE_ARRIVAL_SPREAD_S = 60.0
"""Clique frames: every present user queries once, at a uniform instant of this window."""


class AuditError(CloakingError, InputError, ValueError):
    """Bad audit input (unknown algorithm, too few users, …): exit 2 at the CLI."""


# -- worlds -----------------------------------------------------------------------------------
def _views(
    ids: list[str], lat: Sequence[F64], lon: Sequence[F64], now: Sequence[float], seed: int
) -> tuple[IndexView, ...]:
    return tuple(
        IndexView.from_points(ids, la, lo, now=nw, epoch=f, seed=seed)
        for f, (la, lo, nw) in enumerate(zip(lat, lon, now, strict=True))
    )


def with_profile(world: World, profile: PrivacyProfile, seed: int = 0) -> World:
    """The same world whose views carry ``profile`` as every user's stored profile (§3.1)."""
    frames = []
    for view in world.frames:
        n = len(view)
        frames.append(
            IndexView(
                user_ids=view.user_ids,
                lat=np.array(view.lat),
                lon=np.array(view.lon),
                t=np.array(view.t),
                k=np.full(n, profile.k, np.int64),
                min_area_m2=np.full(n, profile.min_area_m2),
                max_area_m2=np.full(n, profile.max_area_m2),
                now=view.now,
                epoch=view.epoch,
                seed=seed,
            )
        )
    return replace(world, frames=tuple(frames))


def synthetic_world(
    n_users: int = DEFAULT_SYNTHETIC_USERS,
    *,
    frames: int = 20,
    dt_s: float = 30.0,
    seed: int = 0,
    at_home: float = 0.3,
    at_place: float = 0.15,
    places: PlacesLayer | None = None,
) -> World:
    """A clustered city around Beijing moving over ``frames`` instants ``dt_s`` apart (see module doc)."""
    if n_users < 2 or frames < 1 or dt_s <= 0 or not (at_home >= 0 and at_place >= 0 and at_home + at_place <= 1):
        raise AuditError("synthetic world: users ≥ 2, frames ≥ 1, dt > 0, at_home + at_place ≤ 1")
    layer = places if places is not None else PlacesLayer.bundled()
    both = clustered_population(2 * n_users, seed=seed)
    lat, lon = both.lat[:n_users].copy(), both.lon[:n_users].copy()
    homes = np.column_stack([both.lat[n_users:], both.lon[n_users:]])
    rng = np.random.default_rng([seed, 21])
    role = rng.random(n_users)
    home_now = role < at_home
    place_now = (role >= at_home) & (role < at_home + at_place)
    cos = np.cos(np.radians(lat))
    lat[home_now] = homes[home_now, 0] + rng.normal(0, 5.0, home_now.sum()) / M_PER_DEG
    lon[home_now] = homes[home_now, 1] + rng.normal(0, 5.0, home_now.sum()) / (M_PER_DEG * cos[home_now])
    if len(layer):
        popularity = rng.lognormal(0.0, 1.5, len(layer))  # a few places draw crowds
        pick = rng.choice(len(layer), size=int(place_now.sum()), p=popularity / popularity.sum())
        lat[place_now] = layer.lat[pick] + rng.normal(0, 15.0, len(pick)) / M_PER_DEG
        lon[place_now] = layer.lon[pick] + rng.normal(0, 15.0, len(pick)) / (
            M_PER_DEG * np.cos(np.radians(layer.lat[pick]))
        )
    moving = ~(home_now | place_now)
    speed = np.where(moving, rng.uniform(0.5, 12.0, n_users), 0.0)
    heading = rng.uniform(0, 2 * math.pi, n_users)
    ids = user_ids(n_users)
    lats: list[F64] = []
    lons: list[F64] = []
    for _ in range(frames):
        lats.append(lat.copy())
        lons.append(lon.copy())
        heading = heading + rng.normal(0, 0.5, n_users)
        step = speed * dt_s
        lat = lat + step * np.cos(heading) / M_PER_DEG
        lon = lon + step * np.sin(heading) / (M_PER_DEG * np.cos(np.radians(lat)))
    now = [SYNTHETIC_NOW + f * dt_s for f in range(frames)]
    views = _views(ids, lats, lons, now, seed)
    glob = np.arange(n_users, dtype=np.int64)
    return World(
        user_ids=tuple(ids),
        frames=views,
        present=tuple(glob for _ in range(frames)),
        homes=homes,
        places=layer,
        description={
            "source": "synthetic",
            "model": "clustered, moving",
            "users": n_users,
            "frames": frames,
            "frame_interval_s": dt_s,
            "at_home_fraction": at_home,
            "at_place_fraction": at_place,
            "speed_m_s": [0.5, 12.0],
            "homes": "generator (same clustered distribution as positions)",
            "places": f"bundled Beijing POIs ({len(layer)}), log-normal popularity (σ 1.5)",
        },
    )


def stay_points(
    t: F64, lat: F64, lon: F64, *, radius_m: float = 200.0, min_s: float = 1200.0
) -> list[tuple[float, float, float, float]]:
    """Stay points of one trajectory sorted by time: ``(t_arrive, t_leave, lat, lon)``.

    Li et al. (2008): from an anchor fix, extend while the fixes stay within ``radius_m`` of it;
    a run lasting at least ``min_s`` is a stay at the mean position; continue after it.
    """
    out: list[tuple[float, float, float, float]] = []
    n = len(t)
    i = 0
    while i < n - 1:
        d = _dist_m(lat[i], lon[i], lat[i + 1 :], lon[i + 1 :])
        far = np.flatnonzero(d > radius_m)
        j = i + 1 + int(far[0]) if len(far) else n  # first fix outside the radius
        if t[j - 1] - t[i] >= min_s:
            out.append((float(t[i]), float(t[j - 1]), float(np.mean(lat[i:j])), float(np.mean(lon[i:j]))))
            i = j
        else:
            i += 1
    return out


def _dist_m(lat0: float, lon0: float, lat: F64, lon: F64) -> F64:
    out: F64 = np.hypot((lat - lat0) * M_PER_DEG, (lon - lon0) * M_PER_DEG * math.cos(math.radians(lat0)))
    return out


def _night_overlap_s(t0: float, t1: float, lon: float) -> float:
    """Seconds of ``[t0, t1]`` falling in 00–06 local solar time (UTC offset = round(lon / 15) h)."""
    off = round(lon / 15.0) * 3600.0
    total = 0.0
    day0 = math.floor((t0 + off) / 86400.0)
    day1 = math.floor((t1 + off) / 86400.0)
    for day in range(day0, day1 + 1):
        a, b = day * 86400.0 - off, day * 86400.0 - off + 6 * 3600.0
        total += max(0.0, min(b, t1) - max(a, t0))
    return total


def homes_from_trace(fixes: FixTable, ids: Sequence[str], *, radius_m: float = 200.0, min_s: float = 1200.0) -> F64:
    """Home of each trajectory of ``ids``: its night-time stay point, else its longest stay (NaN: none)."""
    s = fixes.sorted()
    homes = np.full((len(ids), 2), np.nan)
    where = {u: i for i, u in enumerate(ids)}
    starts = np.flatnonzero(np.r_[True, s.traj_id[1:] != s.traj_id[:-1]])
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        i = where.get(str(s.traj_id[a]))
        if i is None:
            continue
        stays = stay_points(s.t[a:b], s.lat[a:b], s.lon[a:b], radius_m=radius_m, min_s=min_s)
        if not stays:
            continue
        best = max(stays, key=lambda st: (_night_overlap_s(st[0], st[1], st[3]), st[1] - st[0]))
        homes[i] = best[2], best[3]
    return homes


def trace_world(
    fixes: FixTable,
    *,
    frames: int = 20,
    window_s: float | None = None,
    places: PlacesLayer | None = None,
    seed: int = 0,
    source: str = "data",
) -> World:
    """Successive snapshots of a trace, evenly spread over ``[t_min + W, t_max]`` (see module doc)."""
    if len(fixes) == 0:
        raise AuditError("data: no usable fixes")
    if frames < 1:
        raise AuditError("snapshots: must be at least 1")
    w = auto_window_s(fixes) if window_s is None else float(window_s)
    s = fixes.sorted()
    ids_all, inv = np.unique(s.traj_id, return_inverse=True)
    t0, t1 = float(s.t.min()) + w, float(s.t.max())
    if t1 < t0:
        t0 = t1
    instants = [t1] if frames == 1 else list(np.linspace(t0, t1, frames))
    ids = [f"u{i:07d}" for i in range(len(ids_all))]
    lats: list[F64] = []
    lons: list[F64] = []
    ts: list[F64] = []
    present: list[I64] = []
    for at in instants:
        keep = (s.t <= at) & (s.t >= at - w)
        g = inv[keep]
        last = np.ones(len(g), bool)
        last[:-1] = g[1:] != g[:-1]
        present.append(g[last].astype(np.int64))
        lats.append(s.lat[keep][last])
        lons.append(s.lon[keep][last])
        ts.append(s.t[keep][last])
    views = tuple(
        IndexView.from_points([ids[i] for i in p.tolist()], la, lo, t=tt, now=float(at), epoch=f, seed=seed)
        for f, (p, la, lo, tt, at) in enumerate(zip(present, lats, lons, ts, instants, strict=True))
    )
    homes = homes_from_trace(fixes, [str(x) for x in ids_all])
    layer = places if places is not None else PlacesLayer.bundled()
    return World(
        user_ids=tuple(ids),
        frames=views,
        present=tuple(present),
        homes=homes,
        places=layer,
        description={
            "source": source,
            "users": len(ids),
            "frames": len(instants),
            "frame_t": [float(x) for x in instants],
            "window_s": w,
            "present_per_frame": [len(p) for p in present],
            "fixes": len(fixes),
            "bad_rows": fixes.bad_rows,
            "homes_known": int(np.count_nonzero(np.isfinite(homes[:, 0]))),
            "homes": "night-time stay point, else longest stay point (200 m, 20 min)",
            "places": f"bundled Beijing POIs ({len(layer)})",
        },
    )


# -- forwarding -------------------------------------------------------------------------------
def forward_all(algorithm: str, view: IndexView, profile: PrivacyProfile, *, seed: int = 0) -> Forwarded:
    """The region ``algorithm`` forwards for a request of every present user of ``view``.

    Snapshot cloakers run ``cloak_batch``; ``clique`` holds requests, so every user submits one at
    a uniform instant of a :data:`CLIQUE_ARRIVAL_SPREAD_S` window (positions of the frame) and its
    region is the box of the clique it is released in (expired → refused).
    """
    n = len(view)
    if algorithm == "clique":
        from kcloak.cloaking.cloakers.clique import CliqueCloak, CliqueRequest

        rng = np.random.default_rng([seed, view.epoch, 31])
        at = view.now + rng.uniform(0.0, CLIQUE_ARRIVAL_SPREAD_S, n)
        reqs = [
            (
                float(at[r]),
                CliqueRequest.from_profile(
                    str(r), view.user_ids[r], float(view.lat[r]), float(view.lon[r]), float(at[r]), profile
                ),
            )
            for r in range(n)
        ]
        releases, _ = CliqueCloak(seed=seed).run_stream(reqs)
        bbox = np.zeros((n, 4), np.int64)
        ok = np.zeros(n, bool)
        for rel in releases:
            b = rel.bbox
            for m in rel.members:
                r = int(m.request_id)
                bbox[r] = (b.min_lon_udeg, b.min_lat_udeg, b.max_lon_udeg, b.max_lat_udeg)
                ok[r] = True
        return Forwarded(bbox, ok)
    cloaker = get_cloaker(algorithm)
    res = cloaker.cloak_batch(view, np.arange(n, dtype=np.int64), ProfileArrays.uniform(profile, n))
    return Forwarded(np.asarray(res.bbox, np.int64), np.asarray(res.ok, bool))


def session_runner(
    algorithm: str, world: World, forwarded: Sequence[Forwarded], profile: PrivacyProfile, *, refreshes: int | None
) -> Session | None:
    """Continuous sessions with k-sharing and memorization (contract §6) from :mod:`kcloak.cloaking.continuous`.

    The first region is the audited algorithm's region at the start frame; every later frame is a
    refresh, until the session ends (``k_unreachable``/``area_exceeded``). A refresh refused because
    the querier is not present (``stale_position``) forwards nothing and the session goes on.
    None when the continuous module is not available.
    """
    try:
        from kcloak.cloaking import continuous
    except ModuleNotFoundError:
        return None
    from kcloak.cloaking.cloakers.base import Region
    from kcloak.core.profile import ReasonCode

    def run(start: int, user: int) -> list[tuple[int, BBox]]:
        row = int(world.row_of_user[start][user])
        fwd = forwarded[start]
        if row < 0 or not fwd.ok[row]:
            return []
        view = world.frames[start]
        box = fwd.box(row)
        region = Region(
            bbox=box, k_achieved=view.count_in(box), area_m2=box.area_m2, algorithm=algorithm, epoch=view.epoch
        )
        try:
            group = continuous.SharedGroup.start(view, view.user_ids[row], region, profile)
        except continuous.SessionError:
            return []
        out = [(start, box)]
        end = len(world.frames) if refreshes is None else min(len(world.frames), start + refreshes)
        for f in range(start + 1, end):
            v = world.frames[f]
            result = group.refresh(v, view.user_ids[row], profile)
            if isinstance(result, Region):
                out.append((f, result.bbox))
                continue
            if getattr(result, "reason", None) == ReasonCode.STALE_POSITION:
                continue
            break
        return out

    return run


# -- the audit --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AuditConfig:
    """Parameters of ``kcloak audit cloaking`` (contract §9 defaults)."""

    algorithms: tuple[str, ...] = SPATIAL_ALGORITHMS
    ks: tuple[int, ...] = DEFAULT_KS
    queries: int = 1000
    observed_fraction: float = 0.1
    seed: int = 0
    attacks: tuple[AttackName, ...] = ATTACKS
    max_area_m2: float = PrivacyProfile().max_area_m2
    session_refreshes: int | None = None

    def __post_init__(self) -> None:
        for a in self.algorithms:
            if a not in SPATIAL_ALGORITHMS:
                raise AuditError(f"algorithms: unknown algorithm {a!r} (known: {', '.join(SPATIAL_ALGORITHMS)})")
        if not self.algorithms or not self.ks or any(not 1 <= k <= 1000 for k in self.ks):
            raise AuditError("k: every k must be within [1, 1000]")
        if self.queries < 1:
            raise AuditError("queries: must be at least 1")
        if not 0 <= self.observed_fraction <= 1:
            raise AuditError("observed-fraction: must be within [0, 1]")


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One contract row (``algorithm, k, attack, success_rate, baseline, trials, tolerance``) plus details."""

    algorithm: str
    k: int
    attack: str
    success_rate: float | None
    baseline: float
    trials: int
    tolerance: float | None
    refused: int = 0
    area_m2_median: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def contract(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "k": self.k,
            "attack": self.attack,
            "success_rate": self.success_rate,
            "baseline": self.baseline,
            "trials": self.trials,
            "tolerance": self.tolerance,
        }

    def detailed(self) -> dict[str, Any]:
        return {**self.contract(), "refused": self.refused, "area_m2_median": self.area_m2_median, **dict(self.extra)}

    @property
    def holds(self) -> bool | None:
        if self.success_rate is None or self.tolerance is None:
            return None
        return self.success_rate <= self.baseline + self.tolerance


@dataclass(frozen=True, slots=True)
class AuditReport:
    config: AuditConfig
    world: Mapping[str, Any]
    rows: tuple[AuditRow, ...]

    def to_json(self) -> dict[str, Any]:
        """The contract's ``--json`` object."""
        return {"results": [r.contract() for r in self.rows]}

    def detailed_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "config": {
                "algorithms": list(c.algorithms),
                "k": list(c.ks),
                "queries": c.queries,
                "observed_fraction": c.observed_fraction,
                "seed": c.seed,
                "max_area_m2": c.max_area_m2,
                "session_refreshes": c.session_refreshes,
            },
            "world": dict(self.world),
            "results": [r.detailed() for r in self.rows],
        }


def snapshot_targets(world: World, queries: int, seed: int) -> list[Target]:
    """``queries`` requests spread evenly over the frames; queriers drawn uniformly among the present users."""
    rng = np.random.default_rng([seed, 41])
    nf = len(world.frames)
    out: list[Target] = []
    for f in range(nf):
        q = queries // nf + (1 if f < queries % nf else 0)
        glob = world.present[f]
        if not len(glob) or not q:
            continue
        pick = rng.choice(len(glob), size=q, replace=q > len(glob))
        out.extend(Target(f, int(glob[i])) for i in pick.tolist())
    return out


def tracking_targets(world: World, queries: int, seed: int) -> list[Target]:
    """Continuous queries started at frame 0 by up to ``queries`` distinct present users."""
    rng = np.random.default_rng([seed, 43])
    glob = world.present[0]
    pick = rng.choice(len(glob), size=min(queries, len(glob)), replace=False)
    return [Target(0, int(glob[i])) for i in np.sort(pick).tolist()]


def make_attack(name: AttackName, config: AuditConfig) -> CloakingAttack:
    match name:
        case AttackName.CENTRE:
            return CentreGuess()
        case AttackName.BOUNDARY:
            return BoundaryGuess()
        case AttackName.OBSERVATION:
            return ObservationIdentification(observed_fraction=config.observed_fraction, seed=config.seed)
        case AttackName.RESTRICTED_SPACE:
            return RestrictedSpaceIdentification()
        case AttackName.QUERY_TRACKING_NAIVE:
            return QueryTrackingNaive(refreshes=config.session_refreshes)
        case AttackName.QUERY_TRACKING_SESSION:
            return QueryTrackingSession(refreshes=config.session_refreshes)
        case AttackName.HOMOGENEITY:
            return Homogeneity()
    raise AuditError(f"unknown attack {name!r}")  # pragma: no cover


def cloak_world(
    world: World,
    algorithm: str,
    profile: PrivacyProfile,
    *,
    seed: int,
    session_refreshes: int | None = None,
    on_frame: Callable[[], None] | None = None,
) -> CloakedWorld:
    """Forward a request of every present user at every frame (the attacker's K1 + K2 recomputation);
    ``on_frame`` is called after each frame."""
    w = with_profile(world, profile, seed)
    out: list[Forwarded] = []
    for v in w.frames:
        out.append(forward_all(algorithm, v, profile, seed=seed))
        if on_frame is not None:
            on_frame()
    fwd = tuple(out)
    return CloakedWorld(
        w, algorithm, profile, fwd, session_runner(algorithm, w, fwd, profile, refreshes=session_refreshes)
    )


def check_population(*, snapshots: int, users: int | None, with_data: bool, observed_fraction: float) -> None:
    """The population flags of ``kcloak audit cloaking`` (and of :func:`kcloak.audit_cloaking`), checked
    before any work: :class:`AuditError` naming the flag as the command line spells it."""
    if snapshots < 1:
        raise AuditError("--snapshots: must be at least 1")
    if users is not None and (with_data or users < 2):
        raise AuditError("--users: at least 2, and only without --data")
    if not (math.isfinite(observed_fraction) and 0 <= observed_fraction <= 1):
        raise AuditError("--observed-fraction: must be within [0, 1]")


def audit_world(
    fixes: FixTable | None, *, users: int | None = None, snapshots: int = 20, seed: int = 0, source: str = "data"
) -> World:
    """The population of ``kcloak audit cloaking``: ``snapshots`` snapshots of the trace ``fixes``, or of a
    synthetic city of ``users`` (default :data:`DEFAULT_SYNTHETIC_USERS`) when ``fixes`` is ``None``."""
    if fixes is None:
        return synthetic_world(users or DEFAULT_SYNTHETIC_USERS, frames=snapshots, seed=seed)
    return trace_world(fixes, frames=snapshots, seed=seed, source=source)


def run_audit(world: World, config: AuditConfig, *, progress: Progress | None = None) -> AuditReport:
    """Every attack of ``config`` against every algorithm and k (see module doc)."""
    prog = progress if progress is not None else NullProgress()
    snap = snapshot_targets(world, config.queries, config.seed)
    track = tracking_targets(world, config.queries, config.seed)
    rows: list[AuditRow] = []
    n_phases = len(config.algorithms) * len(config.ks)
    for i, (algorithm, k) in enumerate(itertools.product(config.algorithms, config.ks), start=1):
        # one phase per algorithm and k: cloak every frame, then run every attack
        prog.phase(f"{algorithm} k={k} ({i}/{n_phases})", len(world.frames) + len(config.attacks))
        profile = PrivacyProfile(k=k, max_area_m2=config.max_area_m2)
        data = cloak_world(
            world,
            algorithm,
            profile,
            seed=config.seed,
            session_refreshes=config.session_refreshes,
            on_frame=lambda: prog.advance(1),
        )
        areas = np.concatenate([f.area_m2[f.ok] for f in data.forwarded]) if data.forwarded else np.zeros(0)
        median = float(np.median(areas)) if len(areas) else None
        for name in config.attacks:
            attack = make_attack(name, config)
            targets = track if name in (AttackName.QUERY_TRACKING_NAIVE, AttackName.QUERY_TRACKING_SESSION) else snap
            rows.append(_row(algorithm, k, name, attack, data, targets, median))
            prog.advance(1)
    return AuditReport(config, world.description, tuple(rows))


def _row(
    algorithm: str,
    k: int,
    name: AttackName,
    attack: CloakingAttack,
    data: CloakedWorld,
    targets: Sequence[Target],
    median: float | None,
) -> AuditRow:
    from kcloak.cloaking.attacks import AttackError

    try:
        risk: Risk = attack.assess_risk(data, targets)
    except AttackError as exc:
        return AuditRow(algorithm, k, str(name), None, 1.0 / k, 0, None, 0, median, {"error": str(exc)})
    return AuditRow(
        algorithm,
        k,
        str(name),
        risk.success_rate if risk.trials else None,
        1.0 / k,
        risk.trials,
        risk.tolerance if risk.trials else None,
        risk.refused,
        median,
        dict(risk.extra),
    )


# -- pictures ---------------------------------------------------------------------------------
def figure_title(report: AuditReport) -> str:
    """The pictures' title: what was audited (data, seed, k, requests per row)."""
    ks = "/".join(str(k) for k in report.config.ks)
    world = report.world
    source = world.get("source", "synthetic")
    users = world.get("users")
    frames = world.get("frames")
    where = f"{source}" + (f", {users:,} users" if isinstance(users, int) else "")
    where += f", {frames} snapshots" if isinstance(frames, int) else ""
    return (
        f"kcloak audit cloaking: {where}; seed {report.config.seed}; k = {ks}; "
        f"{report.config.queries:,} attacked requests per bar"
    )


NEAR_ZERO = 0.01
"""A panel whose every success rate is below this says so in words (its bars are too low to see)."""


def _y_top(values: Sequence[float]) -> float:
    """A panel's y range: up to 1 when a rate is high, else zoomed so that small rates and 1/k stay visible."""
    high = max((v for v in values if math.isfinite(v)), default=0.0)
    return 1.05 if high > 0.5 else max(0.25, 1.2 * high)


def write_figures(report: AuditReport, directory: Any) -> list[str]:
    """``attack_success.png`` (success per cloaker against 1/k) and ``frontier.png`` (success vs median area),
    each titled with the data, seed and k values; a panel whose attack never succeeded says so."""
    from pathlib import Path

    require_pictures()
    import matplotlib.pyplot as plt

    out = Path(directory)
    rows = [r for r in report.rows if r.success_rate is not None]
    attacks = list(dict.fromkeys(r.attack for r in report.rows))
    algos = list(dict.fromkeys(r.algorithm for r in report.rows))
    ks = sorted({r.k for r in report.rows})
    cols = 4
    nrows = max(1, math.ceil(len(attacks) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    width = 0.8 / max(1, len(ks))
    title = figure_title(report)
    for ax, attack in zip(axes.flat, attacks, strict=False):
        shown: list[float] = []
        trials = 0
        for j, k in enumerate(ks):
            vals = []
            errs = []
            for a in algos:
                r = next((x for x in rows if x.attack == attack and x.algorithm == a and x.k == k), None)
                vals.append(r.success_rate if r and r.success_rate is not None else np.nan)
                errs.append(r.tolerance if r and r.tolerance is not None else 0.0)
                trials += r.trials if r else 0
            xs = np.arange(len(algos)) + (j - (len(ks) - 1) / 2) * width
            ax.bar(xs, vals, width, yerr=errs, capsize=2, label=f"k={k}")
            ax.hlines(1.0 / k, xs[0] - width / 2, xs[-1] + width / 2, colors="k", linestyles="dashed", linewidth=0.8)
            shown += [v + e for v, e in zip(vals, errs, strict=True)] + [1.0 / k]
        ax.set_title(attack)
        ax.set_xticks(np.arange(len(algos)), algos, rotation=30, fontsize=8)
        top = _y_top(shown)
        ax.set_ylim(0, top)
        if top < 1.0:
            ax.set_title(f"{attack} (zoomed to {top:.2f})")
        best = max((r.success_rate or 0.0 for r in rows if r.attack == attack), default=0.0)
        if best < NEAR_ZERO:  # bars too low to see: say what they are
            note = f"no success in {trials:,} trials" if best == 0 else f"every rate ≤ {best:.3f} ({trials:,} trials)"
            ax.text(0.5, 0.6, note, ha="center", transform=ax.transAxes, fontsize=9)
        ax.set_ylabel("success rate")
    for ax in list(axes.flat)[len(attacks) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, title="dashed: 1/k; bars: ± tolerance", title_fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.14, top=0.88, wspace=0.3, hspace=0.55)
    fig.savefig(out / "attack_success.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    markers = "osD^v<>p"
    for ax, attack in zip(axes.flat, attacks, strict=False):
        shown = []
        for i, a in enumerate(algos):
            pts = [
                (r.area_m2_median, r.success_rate, r.k)
                for r in rows
                if r.attack == attack and r.algorithm == a and r.area_m2_median
            ]
            if not pts:
                continue
            xs2, ys, _ = zip(*pts, strict=True)
            (line,) = ax.plot(xs2, ys, marker=markers[i % len(markers)], label=a)
            for x, y, kv in (pts[0], pts[-1]) if len(pts) > 1 else pts:  # the ends: k grows along the line
                ax.annotate(
                    f"k={kv}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=6, color=line.get_color()
                )
            shown += list(ys)
        ax.set_xscale("log")
        ax.margins(x=0.25)  # room for the k labels of the points at either end
        ax.set_title(attack)
        ax.set_xlabel("median region area (m²)")
        ax.set_ylabel("success rate")
        top = _y_top([y * 1.1 for y in shown])
        ax.set_ylim(0, top)
        if top < 1.0:
            ax.set_title(f"{attack} (zoomed to {top:.2f})")
    for ax in list(axes.flat)[len(attacks) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title + " (each point one k; lower left is better)", fontsize=11)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.14, top=0.88, wspace=0.3, hspace=0.55)
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
    return ["attack_success.png", "frontier.png"]


__all__ = [
    "ATTACKS",
    "DEFAULT_KS",
    "AuditConfig",
    "AuditError",
    "AuditReport",
    "AuditRow",
    "audit_world",
    "check_population",
    "cloak_world",
    "forward_all",
    "homes_from_trace",
    "run_audit",
    "session_runner",
    "snapshot_targets",
    "stay_points",
    "synthetic_world",
    "trace_world",
    "tracking_targets",
    "with_profile",
    "write_figures",
]
