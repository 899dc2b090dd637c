"""kcloak's Python API: anonymize, release and audit trajectories held in pandas DataFrames.

``import kcloak`` exposes :func:`anonymize`, :func:`release`, :func:`audit` and :func:`audit_cloaking`
(loaded on first use, so ``import kcloak`` stays cheap); docs/python-api.md has a worked example. Each
function is the command of the same name on data in memory: the same parameter checks, the same reader
checks (a row with a missing, unparsable, non-finite or out-of-range value, or a repeated
``(traj_id, t)``, is skipped and counted in ``n_bad_rows``), the same algorithms and the same reports,
so ``kcloak.anonymize(df, k=5, delta=500, seed=1)`` publishes what ``kcloak anonymize file.csv --k 5
--delta 500 --seed 1`` writes for the same rows. Errors are the command line's: the exceptions derive
from :class:`kcloak.core.errors.InputError` (bad input, the command's exit 2) or are a refusal
(:class:`~kcloak.streams.publish.NotPublished`, ``ReleaseUnsatisfiable``, ``NothingToRelease``: exit 1),
and their messages name an option as the command line spells it (``--trash-max`` is ``trash_max=``).

Input is a pandas ``DataFrame`` of fixes whose columns are named by ``traj_id_col``, ``t_col``,
``lat_col`` and ``lon_col`` (a scikit-mobility ``TrajDataFrame`` is one: ``traj_id_col="uid",
t_col="datetime", lon_col="lng"``), or a movingpandas ``TrajectoryCollection``. ``t`` is Unix seconds
or a datetime column (a naive datetime is UTC); ``lat``/``lon`` are WGS84 degrees. What comes back
has the kind and the column names that went in.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kcloak.core.readers import FixBuilder, FixTable, ReaderError
from kcloak.streams.publish import NotPublished, check_anonymize_params, refusal_reason
from kcloak.streams.release import LKind, ReleaseOutcome

EXTRA_HINT = "pip install 'kcloak[dataframes]'"
"""The one-line hint when pandas or movingpandas is missing."""

TrajectoryFrame = Any
"""A pandas ``DataFrame`` of fixes or a movingpandas ``TrajectoryCollection`` (pandas has no type stubs here)."""
Int = int | np.integer[Any]
"""An integer parameter: a Python ``int`` or a numpy integer (as it comes out of a DataFrame)."""


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(f"kcloak's Python API needs pandas: {EXTRA_HINT}") from exc
    return pd


def _movingpandas() -> Any:
    try:
        with warnings.catch_warnings():  # movingpandas warns about optional smoothers on import
            warnings.simplefilter("ignore", UserWarning)
            import movingpandas as mpd
    except ImportError as exc:
        raise ImportError(f"a TrajectoryCollection needs movingpandas: {EXTRA_HINT}") from exc
    return mpd


def _int(value: Any) -> Any:
    """A numpy integer as a Python ``int`` (reports are JSON); anything else unchanged, for the checks to judge."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _is_movingpandas(data: object) -> bool:
    """A movingpandas ``TrajectoryCollection``, recognised without importing movingpandas."""
    kind = type(data)
    return kind.__module__.startswith("movingpandas") and kind.__name__ == "TrajectoryCollection"


@dataclass(frozen=True, slots=True)
class _Shape:
    """How the input looked, to give the output the same kind, column names and time type."""

    traj_id: str
    t: str
    lat: str
    lon: str
    datetime: bool = False
    tz: Any = None
    movingpandas: bool = False


def _ids(column: Any, pd: Any) -> list[str | None]:
    """Trajectory ids as text (``None`` when missing); integral floats (an id column with gaps) as integers."""
    if pd.api.types.is_float_dtype(column.dtype):
        values = column.to_numpy(dtype=np.float64, na_value=np.nan)
        whole = np.isfinite(values) & (values == np.floor(values))
        text = np.where(whole, np.where(whole, values, 0).astype(np.int64).astype(str), values.astype(str))
        out: list[str | None] = text.tolist()
    else:
        out = [v if isinstance(v, str) else str(v) for v in column.tolist()]
    for i in np.flatnonzero(column.isna().to_numpy()):
        out[i] = None
    return out


def _seconds(column: Any, pd: Any) -> tuple[list[Any], bool, Any]:
    """The time column as Unix seconds (datetimes converted; NaT → NaN), whether it held datetimes, its zone."""
    dtype = column.dtype
    if pd.api.types.is_datetime64_any_dtype(dtype):
        tz = getattr(dtype, "tz", None)
        epoch = pd.Timestamp(0, tz="UTC") if tz is not None else pd.Timestamp(0)
        return ((column - epoch) / pd.Timedelta(seconds=1)).tolist(), True, tz
    return column.tolist(), False, None


def _fixes(
    data: TrajectoryFrame, traj_id_col: str, t_col: str, lat_col: str, lon_col: str, *, what: str = "DataFrame"
) -> tuple[FixTable, _Shape]:
    """The reader checks (:class:`~kcloak.core.readers.FixBuilder`) on a DataFrame's or a collection's fixes."""
    pd = _pandas()
    if _is_movingpandas(data):
        return _movingpandas_fixes(data, pd)
    if not isinstance(data, pd.DataFrame):
        raise ReaderError(f"{what}: expected a pandas DataFrame or a movingpandas TrajectoryCollection")
    names = (traj_id_col, t_col, lat_col, lon_col)
    missing = [c for c in names if c not in data.columns]
    if missing:
        raise ReaderError(f"{what}: columns must name {', '.join(names)} (missing: {', '.join(missing)})")
    t, is_datetime, tz = _seconds(data[t_col], pd)
    b = FixBuilder()
    b.add_columns(_ids(data[traj_id_col], pd), t, data[lat_col].tolist(), data[lon_col].tolist())
    return b.build(), _Shape(traj_id_col, t_col, lat_col, lon_col, is_datetime, tz)


def _movingpandas_fixes(collection: Any, pd: Any) -> tuple[FixTable, _Shape]:
    points = collection.to_point_gdf()
    if points.crs is not None and points.crs.to_epsg() != 4326:
        points = points.to_crs(4326)
    id_col = collection.get_traj_id_col() if hasattr(collection, "get_traj_id_col") else "traj_id"
    t_name = points.index.name or "t"
    geometry = points.geometry
    empty = geometry.isna() | geometry.is_empty
    lat = np.where(empty, np.nan, geometry.y.where(~empty))
    lon = np.where(empty, np.nan, geometry.x.where(~empty))
    t, _, tz = _seconds(pd.Series(points.index), pd)
    b = FixBuilder()
    b.add_columns(_ids(points[id_col], pd), t, lat.tolist(), lon.tolist())
    return b.build(), _Shape(id_col, t_name, "lat", "lon", True, tz, movingpandas=True)


def _output(table: FixTable, shape: _Shape) -> TrajectoryFrame:
    """Published fixes in the input's kind: a DataFrame (its column names, its time type) or a collection."""
    pd = _pandas()
    t: Any = table.t
    if shape.datetime:
        t = pd.to_datetime(table.t, unit="s", utc=True)
        t = t.tz_convert(shape.tz) if shape.tz is not None else t.tz_localize(None)
    frame = pd.DataFrame(
        {
            shape.traj_id: pd.array(table.traj_id.tolist(), dtype="str"),
            shape.t: t,
            shape.lat: table.lat,
            shape.lon: table.lon,
        }
    )
    if not shape.movingpandas:
        return frame
    mpd = _movingpandas()
    return mpd.TrajectoryCollection(
        frame, traj_id_col=shape.traj_id, t=shape.t, x=shape.lon, y=shape.lat, crs="EPSG:4326"
    )


# -- anonymize --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Anonymized:
    """A (k,δ)-anonymous publication (contract §7).

    ``published``: the fixes to publish, in the input's kind (DataFrame or TrajectoryCollection) with its
    column names; fresh trajectory ids, rows sorted by time and in random order among equal times (what
    ``kcloak anonymize`` writes). ``report``: the contract §7 report (``n_in``, ``n_out``, ``n_trash``,
    ``trash_reasons``, ``n_bad_rows``, translation and time-shift distributions, …). ``trash``: the input
    ids of the trajectories not published. ``mapping``: published id → input id, for audits only (like
    ``--mapping``): never publish it.
    """

    published: TrajectoryFrame
    report: dict[str, Any]
    trash: tuple[str, ...] = ()
    mapping: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def n_bad_rows(self) -> int:
        """Input rows skipped by the reader checks (the report's ``n_bad_rows``)."""
        return int(self.report["n_bad_rows"])

    def __repr__(self) -> str:
        r = self.report
        return (
            f"Anonymized({r['method']}, k={r['k']}, delta={r['delta']:g} m: published {r['n_out']} of {r['n_in']} "
            f"trajectories in {r['n_groups']} groups, trash {r['n_trash']}, bad rows {r['n_bad_rows']})"
        )


def anonymize(
    data: TrajectoryFrame,
    *,
    k: Int,
    delta: float,
    method: str = "nwa",
    trash_max: float = 0.1,
    seed: Int | None = None,
    pi_s: float = 60.0,
    tau_s: float | None = None,
    distance: str = "edr",
    max_time_shift_s: float | None = None,
    max_radius: float | None = None,
    traj_id_col: str = "traj_id",
    t_col: str = "t",
    lat_col: str = "lat",
    lon_col: str = "lon",
) -> Anonymized:
    """Publish trajectories only as (k,δ)-anonymous ones: ``kcloak anonymize`` on a DataFrame.

    Every published trajectory has at least ``k − 1`` others within ``delta`` metres at every instant;
    outliers go to a bounded trash (at most ``trash_max`` of the trajectories). ``method`` is ``"nwa"``
    (Never Walk Alone, the default), ``"w4m"`` (Wait For Me) or ``"microagg"``; ``pi_s`` applies to NWA,
    ``tau_s``, ``distance`` and ``max_time_shift_s`` to W4M, ``max_radius`` to both (see ``kcloak anonymize
    --help``). ``seed`` makes ids and row order reproducible (random by default).

    Raises :class:`~kcloak.streams.kdelta.KDeltaError` for a bad parameter, :class:`ReaderError` for
    missing columns, and :class:`~kcloak.streams.publish.NotPublished` (with its ``report``) when the
    input cannot be published: fewer than ``k`` trajectories, or a trash over ``trash_max``.
    """
    from kcloak.streams.publish import anonymize as run

    group_k: int = _int(k)
    check_anonymize_params(
        method=method,
        k=group_k,
        delta_m=delta,
        trash_max=trash_max,
        pi_s=pi_s,
        tau_s=tau_s,
        distance=distance,
        max_time_shift_s=max_time_shift_s,
        max_radius=max_radius,
    )
    fixes, shape = _fixes(data, traj_id_col, t_col, lat_col, lon_col)
    rel = run(
        fixes,
        method=method,
        k=group_k,
        delta_m=delta,
        trash_max=trash_max,
        seed=_int(seed),
        tau_s=tau_s,
        distance=distance,
        pi_s=pi_s,
        max_time_shift_s=max_time_shift_s,
        max_radius=max_radius,
    )
    if not rel.ok:
        raise NotPublished(f"not published: {refusal_reason(rel.report)}", rel.report)
    return Anonymized(_output(rel.table, shape), rel.report, rel.trash, dict(rel.mapping))


# -- release ----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Released:
    """An anonymized table (contract §8): ``table`` holds the released rows as ``kcloak release`` writes
    them (``row_id`` first, random order, suppressed rows removed, values as text: a generalized value is
    a range or a set), ``report`` the release report, ``sensitive`` Anatomy's ``group_id, <sensitive>,
    count`` table (``None`` for the other algorithms)."""

    table: Any
    report: dict[str, Any]
    sensitive: Any = None

    @property
    def n_bad_rows(self) -> int:
        """Input rows skipped by the reader checks (the report's ``n_bad_rows``)."""
        return int(self.report["n_bad_rows"])

    def __repr__(self) -> str:
        r = self.report
        return (
            f"Released({r['table']} with {r['algorithm']}, k={r['k']}: {r['n_out']} of {r['n_in']} rows, "
            f"k achieved {r['k_achieved']}, suppressed {r['suppressed_rows']}, bad rows {r['n_bad_rows']})"
        )


def _rows_frame(columns: Sequence[str], rows: Sequence[Mapping[str, str]]) -> Any:
    pd = _pandas()
    return pd.DataFrame({c: pd.array([r[c] for r in rows], dtype="str") for c in columns}, columns=list(columns))


def release(
    data: TrajectoryFrame,
    table: str,
    *,
    k: Int,
    l: Int | None = None,  # noqa: E741 - the model's name
    l_kind: LKind = "distinct",
    c: float | None = None,
    t: float | None = None,
    m: Int | None = None,
    algorithm: str | None = None,
    max_suppression: float = 0.01,
    seed: Int | None = None,
    pois: str | Path | None = None,
    stay_radius_m: float = 200.0,
    stay_min_s: float = 1200.0,
    place_precision: int = 7,
    traj_id_col: str = "traj_id",
    t_col: str = "t",
    lat_col: str = "lat",
    lon_col: str = "lon",
) -> Released:
    """Build ``table`` (``"trips"``, ``"staypoints"`` or ``"places"``) from trajectories and release it
    anonymized: ``kcloak release TABLE`` on a DataFrame.

    ``k``-anonymity (``mondrian`` by default; ``algorithm`` names another), with ``l``-diversity
    (``l_kind`` distinct, entropy or recursive with ``c``) and ``t``-closeness of the sensitive column
    when given; places take k^m-anonymity (``m``, default 2; ``acd`` or ``aa``). At most
    ``max_suppression`` of the rows are suppressed. ``pois`` is a POI file for stay point categories
    (the bundled Beijing POIs by default). ``t`` is t-closeness: the time column is ``t_col``.

    Raises ``ReleaseError``/``TableError`` (input errors) for parameters or combinations that do not
    apply, ``NothingToRelease`` when the trajectories yield no row, ``ReleaseUnsatisfiable`` when the
    requirements cannot be met within ``max_suppression``.
    """
    from kcloak.core.places import load_pois
    from kcloak.streams.release import ReleaseParams, check_not_empty, check_params, release_table
    from kcloak.streams.tables import BuildOptions, TableError, TableKind, build_from_fixes

    try:
        kind = TableKind(table)
    except ValueError:
        raise TableError(f"table: must be one of {', '.join(TableKind)}") from None
    params = ReleaseParams(
        k=_int(k),
        algorithm=algorithm,
        l=_int(l),
        l_kind=l_kind,
        c=c,
        t=t,
        m=_int(m),
        max_suppression=max_suppression,
        seed=_int(seed),
    )
    options = BuildOptions(stay_radius_m=stay_radius_m, stay_min_s=stay_min_s, place_precision=place_precision)
    check_params(kind, params)
    places = load_pois(pois) if kind is TableKind.STAYPOINTS else None
    fixes, _ = _fixes(data, traj_id_col, t_col, lat_col, lon_col)
    built = build_from_fixes(fixes, kind, options, places)
    check_not_empty(built, "DataFrame", from_table_rows=False)
    outcome: ReleaseOutcome = release_table(built, params)
    sensitive = None
    if outcome.sensitive_columns is not None and outcome.sensitive_rows is not None:
        sensitive = _rows_frame(outcome.sensitive_columns, outcome.sensitive_rows)
    return Released(_rows_frame(outcome.columns, outcome.rows), outcome.report, sensitive)


# -- audit ------------------------------------------------------------------------------------
AUDIT_COLUMNS: tuple[str, ...] = (
    "target",
    "m",
    "reidentification_rate",
    "baseline",
    "tolerance",
    "trials",
    "suppressed",
    "candidates_median",
    "mean_translation_m",
)
"""Columns of :func:`audit`'s DataFrame, one row per target and number of known points."""


def audit(
    published: Anonymized | TrajectoryFrame,
    original: TrajectoryFrame,
    *,
    k: Int | None = None,
    delta: float | None = None,
    m: Sequence[Int] = (1, 2, 3),
    mapping: Mapping[str, str] | None = None,
    methods: Sequence[str] = (),
    seed: Int | None = None,
    traj_id_col: str = "traj_id",
    t_col: str = "t",
    lat_col: str = "lat",
    lon_col: str = "lon",
) -> Any:
    """What an attacker who knows ``m`` points of a victim's trajectory learns: ``kcloak audit trajectories``.

    Verifies (k,δ)-anonymity of ``published`` from its rows alone, then runs the known-points linkage
    against the raw data (target ``raw``), against ``published`` when ``mapping`` (published id → input
    id) gives the ground truth (target ``published``), and against each of ``methods`` run here on
    ``original``. ``published`` may be an :class:`Anonymized` result: its fixes, its ``mapping`` and its
    ``k`` and ``delta`` are then the defaults.

    Returns a DataFrame with the columns :data:`AUDIT_COLUMNS`, one row per target and ``m``;
    ``reidentification_rate`` is to be read next to ``baseline`` (1/k; NaN when there was no trial).
    ``.attrs["kdelta"]`` holds the verdict on ``published`` (``ok``, ``violations``, ``trajectories``),
    ``.attrs["seed"]`` the seed and ``.attrs["notes"]`` the notes the command prints. A published set that
    is not (k,δ)-anonymous (the command's exit 1) also gives a :class:`UserWarning`.
    """
    from kcloak.streams.attacks import LinkageError, audit_seed, audit_trajectories, check_audit_params

    pd = _pandas()
    if isinstance(published, Anonymized):
        k = int(published.report["k"]) if k is None else k
        delta = float(published.report["delta"]) if delta is None else delta
        mapping = published.mapping if mapping is None else mapping
        published = published.published
    if k is None or delta is None:
        raise LinkageError("--k and --delta: give the k and delta of the publication")
    group_k: int = _int(k)
    ms = tuple(dict.fromkeys(_int(x) for x in m))
    chosen = tuple(dict.fromkeys(methods))
    check_audit_params(k=group_k, delta_m=delta, ms=ms, methods=chosen)
    seed = audit_seed(_int(seed))
    columns = (traj_id_col, t_col, lat_col, lon_col)
    pub, _ = _fixes(published, *columns, what="published")
    orig, _ = _fixes(original, *columns, what="original")
    result = audit_trajectories(
        orig,
        pub,
        k=group_k,
        delta_m=delta,
        ms=ms,
        mapping=dict(mapping) if mapping else None,
        methods=chosen,
        seed=seed,
    )
    rows = [r.detailed() for r in result.rows]
    frame = pd.DataFrame([[r[c] for c in AUDIT_COLUMNS] for r in rows], columns=list(AUDIT_COLUMNS))
    frame = frame.astype({"reidentification_rate": "float64", "baseline": "float64", "tolerance": "float64"})
    verdict = result.to_json()["kdelta"]
    frame.attrs["kdelta"] = {**verdict, "no_cylinder_certificate": result.warnings}
    frame.attrs["seed"] = seed
    frame.attrs["notes"] = list(result.notes)
    if not result.kdelta_ok:
        warnings.warn(
            f"published is not (k,δ)-anonymous: {verdict['violations']} violations over "
            f"{verdict['trajectories']} trajectories",
            UserWarning,
            stacklevel=2,
        )
    return frame


CLOAKING_AUDIT_COLUMNS: tuple[str, ...] = (
    "algorithm",
    "k",
    "attack",
    "success_rate",
    "baseline",
    "tolerance",
    "trials",
    "holds",
    "refused",
    "area_m2_median",
)
"""Columns of :func:`audit_cloaking`'s DataFrame, one row per algorithm, k and attack."""


def audit_cloaking(
    data: TrajectoryFrame | None = None,
    *,
    algorithms: Sequence[str] | None = None,
    k: Sequence[Int] = (5, 10, 20),
    snapshots: int = 20,
    queries: int = 1000,
    observed_fraction: float = 0.1,
    users: int | None = None,
    seed: Int | None = None,
    traj_id_col: str = "traj_id",
    t_col: str = "t",
    lat_col: str = "lat",
    lon_col: str = "lon",
) -> Any:
    """What an attacker who knows the algorithm and every present user's position learns from the cloaked
    regions: ``kcloak audit cloaking``.

    Each algorithm (all six by default) cloaks a request of every present user at every snapshot; the
    attacks (centre, boundary, observation, restricted_space, homogeneity, query_tracking_naive,
    query_tracking_session) then target ``queries`` requests. The population is ``snapshots``
    successive snapshots of the trace ``data`` (a DataFrame or collection of fixes), or of a synthetic
    clustered city of ``users`` (3,000) around Beijing when ``data`` is ``None``.

    Returns a DataFrame with the columns :data:`CLOAKING_AUDIT_COLUMNS`: ``success_rate`` next to
    ``baseline`` (1/k) and ``tolerance`` (the 99.9 % Wilson bound of a rate equal to 1/k over ``trials``,
    minus 1/k); ``holds`` is whether ``success_rate ≤ baseline + tolerance`` (missing without trials).
    ``.attrs`` holds ``seed`` and ``world`` (the population's description).
    """
    from kcloak.cloaking.audit import AuditConfig, audit_world, check_population, run_audit
    from kcloak.cloaking.cloakers import SPATIAL_ALGORITHMS
    from kcloak.streams.attacks import audit_seed

    pd = _pandas()
    check_population(snapshots=snapshots, users=users, with_data=data is not None, observed_fraction=observed_fraction)
    seed = audit_seed(_int(seed))
    config = AuditConfig(
        algorithms=tuple(dict.fromkeys(SPATIAL_ALGORITHMS if algorithms is None else algorithms)),
        ks=tuple(dict.fromkeys(_int(x) for x in k)),
        queries=queries,
        observed_fraction=observed_fraction,
        seed=seed,
    )
    fixes = None if data is None else _fixes(data, traj_id_col, t_col, lat_col, lon_col)[0]
    world = audit_world(fixes, users=users, snapshots=snapshots, seed=seed, source="DataFrame")
    report = run_audit(world, config)
    rows = [{**r.detailed(), "holds": r.holds} for r in report.rows]
    frame = pd.DataFrame([[r[c] for c in CLOAKING_AUDIT_COLUMNS] for r in rows], columns=list(CLOAKING_AUDIT_COLUMNS))
    frame = frame.astype({"success_rate": "float64", "baseline": "float64", "tolerance": "float64", "holds": "boolean"})
    frame.attrs["seed"] = seed
    frame.attrs["world"] = dict(report.world)
    return frame


__all__ = [
    "AUDIT_COLUMNS",
    "CLOAKING_AUDIT_COLUMNS",
    "EXTRA_HINT",
    "Anonymized",
    "Released",
    "anonymize",
    "audit",
    "audit_cloaking",
    "release",
]
