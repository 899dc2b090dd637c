"""The ``kcloak demo`` report: what a client saw, as ``summary.json`` and four pictures (contract §9 ``demo``).

:class:`Observations` collects, from the client side only, the updates and queries a simulation
sent and the answers it got back (contract §3 answer JSON: ``status``, ``reason``, ``area_m2``,
``k_achieved``, ``region``). :func:`summarize` turns them into the contract's ``summary.json``
object; :func:`write_report` writes it beside ``map.png`` (users and a sample of cloaked regions
over the street network), ``cloak_area.png``, ``achieved_k.png`` and ``latency.png``
(distributions). Pictures are drawn on :class:`matplotlib.figure.Figure` objects rendered by the
Agg canvas, so no GUI backend or global pyplot state is touched; matplotlib is imported on first
use (:func:`load_plotting` warms it up ahead of time).

Definitions (also in ``kcloak demo --help``): ``queries`` counts queries sent; ``ok`` and
``refused`` count answers and ``unanswered`` the queries left without one when the run ended
(``queries = ok + refused + unanswered``); ``success_rate`` = ``ok / (ok + refused)``; latency is the client's
time from sending a query to receiving its answer (ok or refused), p50/p99 by linear
interpolation between order statistics (numpy's default); ``cloak_area_m2_median`` and
``achieved_k_mean`` are over ``ok`` answers (CONCEPTS §9 quality measures: area and k of the
forwarded region).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from kcloak.core.extras import require_pictures
from kcloak.simulators.streets import StreetGraph

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.path import Path as MplPath

FloatArray = npt.NDArray[np.float64]

SUMMARY_KEYS: Final = (
    "users",
    "duration_s",
    "algorithm",
    "updates",
    "updates_per_s",
    "queries",
    "ok",
    "refused",
    "success_rate",
    "refusals",
    "cloak_area_m2_median",
    "achieved_k_mean",
    "latency_ms_p50",
    "latency_ms_p99",
    "published_windows",
)
"""Keys of ``summary.json``, in the contract's order (§9 ``--json`` shapes, ``demo``)."""

EXTENSION_KEYS: Final = ("unanswered", "skipped_steps")
"""Keys ``summary.json`` adds after the contract's: queries left without an answer when the run
ended, and simulation steps skipped because the machine fell behind the one-second schedule."""

PICTURES: Final = ("map.png", "cloak_area.png", "achieved_k.png", "latency.png")
"""The report's pictures (contract §9 ``demo``)."""

REGION_SAMPLE: Final = 150
"""How many of the most recent ``ok`` regions are kept for the map."""

MAP_CREDIT: Final = "Streets © OpenStreetMap contributors (ODbL)"


@dataclass(frozen=True, slots=True)
class SampledRegion:
    """One forwarded region of an ``ok`` answer: its bbox (GeoJSON order) and ``k_achieved``."""

    min_lon: float
    min_lat: float
    max_lon: float
    max_lat: float
    k_achieved: int


@dataclass(slots=True)
class Observations:
    """Client-side counts and samples of one run (a collector, filled while the run goes)."""

    updates: int = 0
    queries: int = 0
    ok: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    area_m2: list[float] = field(default_factory=list)
    k_achieved: list[int] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    regions: deque[SampledRegion] = field(default_factory=lambda: deque(maxlen=REGION_SAMPLE))
    lat: FloatArray = field(default_factory=lambda: np.empty(0))
    lon: FloatArray = field(default_factory=lambda: np.empty(0))

    @property
    def refused(self) -> int:
        return sum(self.refusals.values())

    @property
    def answers(self) -> int:
        return self.ok + self.refused

    def record_answer(self, answer: Mapping[str, Any], latency_s: float) -> None:
        """Count one answer (contract §3 JSON); an ``ok`` answer also adds its area, k and region."""
        if math.isfinite(latency_s) and latency_s >= 0:
            self.latency_s.append(latency_s)
        if answer.get("status") != "ok":
            reason = answer.get("reason")
            self.refusals[reason if isinstance(reason, str) else "unknown"] += 1
            return
        self.ok += 1
        area = answer.get("area_m2")
        if isinstance(area, (int, float)) and math.isfinite(area):
            self.area_m2.append(float(area))
        k = answer.get("k_achieved")
        if not isinstance(k, int) or isinstance(k, bool):
            return
        self.k_achieved.append(k)
        region = answer.get("region")
        bbox = region.get("bbox") if isinstance(region, dict) else None
        if (
            isinstance(bbox, list)
            and len(bbox) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox)
        ):
            x0, y0, x1, y1 = (float(v) for v in bbox)
            self.regions.append(SampledRegion(x0, y0, x1, y1, k_achieved=k))

    def record_positions(self, lat: FloatArray, lon: FloatArray) -> None:
        """Keep the latest positions of every simulated user (for the map)."""
        self.lat = np.asarray(lat, dtype=np.float64).copy()
        self.lon = np.asarray(lon, dtype=np.float64).copy()


# ---------------------------------------------------------------------------------------------
# summary.json


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) by linear interpolation, None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(
    obs: Observations,
    *,
    users: int,
    duration_s: float,
    algorithm: str,
    published_windows: int,
    skipped_steps: int = 0,
) -> dict[str, Any]:
    """The contract's ``summary.json`` object, keys in the contract's order (§9), then :data:`EXTENSION_KEYS`."""
    answers = obs.answers
    lat_ms = [s * 1000.0 for s in obs.latency_s]
    summary: dict[str, Any] = {
        "users": users,
        "duration_s": round(duration_s, 3),
        "algorithm": algorithm,
        "updates": obs.updates,
        "updates_per_s": round(obs.updates / duration_s, 1) if duration_s > 0 else 0.0,
        "queries": obs.queries,
        "ok": obs.ok,
        "refused": obs.refused,
        "success_rate": _round(obs.ok / answers if answers else None, 4),
        "refusals": dict(sorted(obs.refusals.items())),
        "cloak_area_m2_median": _round(percentile(obs.area_m2, 50), 1),
        "achieved_k_mean": _round(float(np.mean(obs.k_achieved)) if obs.k_achieved else None, 2),
        "latency_ms_p50": _round(percentile(lat_ms, 50), 3),
        "latency_ms_p99": _round(percentile(lat_ms, 99), 3),
        "published_windows": published_windows,
        "unanswered": max(obs.queries - answers, 0),
        "skipped_steps": skipped_steps,
    }
    assert tuple(summary) == SUMMARY_KEYS + EXTENSION_KEYS
    return summary


# ---------------------------------------------------------------------------------------------
# Pictures


STREET_WIDTHS: Final = (
    (frozenset({"motorway", "trunk", "primary", "motorway_link", "trunk_link"}), 0.7),
    (frozenset({"secondary", "tertiary", "primary_link"}), 0.45),
)
"""Line width (points) of the major and middle street classes; every other class is drawn 0.25 wide."""

PATH_CHUNK: Final = 4000
"""Segments per drawn path (Agg renders long compound paths in pieces anyway)."""


def _street_paths(streets: StreetGraph) -> list[tuple[MplPath, float]]:
    """The streets as a few compound paths (one segment per undirected edge), each with its line width.

    One path per width class and :data:`PATH_CHUNK` segments, instead of one artist per segment,
    keeps drawing a city's tens of thousands of segments well under a second.
    """
    from matplotlib.path import Path as MplPath

    lo = np.minimum(streets.tail, streets.head)
    hi = np.maximum(streets.tail, streets.head)
    _, first = np.unique(lo * streets.nodes + hi, return_index=True)
    tail, head = streets.tail[first], streets.head[first]
    widths_by_class = np.array(
        [next((w for names, w in STREET_WIDTHS if h in names), 0.25) for h in streets.highway], dtype=np.float64
    )
    widths: FloatArray = widths_by_class[streets.edge_class[first]] if streets.highway else np.full(first.size, 0.25)
    out: list[tuple[MplPath, float]] = []
    for width in sorted(set(widths.tolist())):
        sel = np.flatnonzero(widths == width)
        for start in range(0, sel.size, PATH_CHUNK):
            part = sel[start : start + PATH_CHUNK]
            verts = np.empty((2 * part.size, 2))
            verts[0::2, 0], verts[0::2, 1] = streets.lon[tail[part]], streets.lat[tail[part]]
            verts[1::2, 0], verts[1::2, 1] = streets.lon[head[part]], streets.lat[head[part]]
            codes = np.tile(np.array([MplPath.MOVETO, MplPath.LINETO], dtype=MplPath.code_type), part.size)
            out.append((MplPath(verts, codes), width))
    return out


def _extent(lat: FloatArray, lon: FloatArray, streets: StreetGraph | None) -> tuple[float, float, float, float]:
    """``(min_lon, min_lat, max_lon, max_lat)`` covering the streets, else the users (padded)."""
    if streets is not None and streets.nodes:
        lo_lon, lo_lat, hi_lon, hi_lat = (
            float(streets.lon.min()),
            float(streets.lat.min()),
            float(streets.lon.max()),
            float(streets.lat.max()),
        )
    elif lat.size:
        lo_lon, lo_lat, hi_lon, hi_lat = float(lon.min()), float(lat.min()), float(lon.max()), float(lat.max())
    else:
        lo_lon, lo_lat, hi_lon, hi_lat = 116.148, 39.788, 116.613, 40.096
    pad_lon = max((hi_lon - lo_lon) * 0.02, 0.002)
    pad_lat = max((hi_lat - lo_lat) * 0.02, 0.002)
    return lo_lon - pad_lon, lo_lat - pad_lat, hi_lon + pad_lon, hi_lat + pad_lat


def _zoom_box(
    lat: FloatArray, lon: FloatArray, regions: Sequence[SampledRegion], half_m: float
) -> tuple[float, float, float, float] | None:
    """A square of side ``2·half_m`` around the region nearest the users' median position."""
    if not regions:
        return None
    if lat.size:
        c_lat, c_lon = float(np.median(lat)), float(np.median(lon))
    else:
        c_lat = float(np.median([(r.min_lat + r.max_lat) / 2 for r in regions]))
        c_lon = float(np.median([(r.min_lon + r.max_lon) / 2 for r in regions]))
    best = min(
        regions, key=lambda r: ((r.min_lat + r.max_lat) / 2 - c_lat) ** 2 + ((r.min_lon + r.max_lon) / 2 - c_lon) ** 2
    )
    c_lat, c_lon = (best.min_lat + best.max_lat) / 2, (best.min_lon + best.max_lon) / 2
    d_lat = math.degrees(half_m / 6_371_008.8)
    d_lon = d_lat / max(math.cos(math.radians(c_lat)), 1e-6)
    return c_lon - d_lon, c_lat - d_lat, c_lon + d_lon, c_lat + d_lat


def plot_map(
    path: Path,
    *,
    lat: FloatArray,
    lon: FloatArray,
    regions: Sequence[SampledRegion],
    streets: StreetGraph | None = None,
    title: str = "",
    dpi: int = 110,
    zoom_half_m: float = 1500.0,
) -> None:
    """Users (dots) and cloaked regions (rectangles coloured by ``k_achieved``) over the streets.

    Two panels: the whole street network, and a square of side ``2·zoom_half_m`` around a region
    near the users' median position, where single regions and the users inside them are visible.
    """
    from matplotlib.collections import PatchCollection, PathCollection
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    fig = Figure(figsize=(12.0, 6.2), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, 2)
    full = _extent(lat, lon, streets)
    full_side_m = math.radians(full[3] - full[1]) * 6_371_008.8
    zoom_half_m = min(zoom_half_m, full_side_m / 5)  # the zoom shows at most 2/5 of the map's height
    zoom = _zoom_box(lat, lon, regions, zoom_half_m) or full
    street_paths = _street_paths(streets) if streets is not None else []
    ks = [r.k_achieved for r in regions]
    norm = Normalize(vmin=min(ks), vmax=max(min(ks) + 1, float(np.percentile(ks, 95)))) if ks else None
    mid_lat = (full[1] + full[3]) / 2
    mappable: PatchCollection | None = None
    for ax, (x0, y0, x1, y1), scale in ((axes[0], full, 1.0), (axes[1], zoom, 2.2)):
        if street_paths:
            streets_art = PathCollection(
                [path for path, _ in street_paths],
                linewidths=[width * scale for _, width in street_paths],
                facecolors="none",
                edgecolors="#b8b8b8",
                zorder=1,
                rasterized=True,
            )
            ax.add_collection(streets_art, autolim=False)
        if regions and norm is not None:
            rects = [Rectangle((r.min_lon, r.min_lat), r.max_lon - r.min_lon, r.max_lat - r.min_lat) for r in regions]
            coll = PatchCollection(rects, cmap="plasma", norm=norm, alpha=0.3, zorder=2, linewidths=0.6 * scale)
            coll.set_array(np.asarray(ks, dtype=np.float64))
            coll.set_edgecolor("face")
            ax.add_collection(coll)
            mappable = coll
        if lat.size:
            ax.scatter(lon, lat, s=1.2 * scale**2, c="#1f4e9c", linewidths=0, zorder=3, rasterized=True)
        ax.set_xlim(x0, x1)
        ax.set_ylim(y0, y1)
        ax.set_aspect(1.0 / math.cos(math.radians(mid_lat)))
        ax.tick_params(labelsize=7)
        ax.ticklabel_format(useOffset=False)
        ax.set_xlabel("longitude", fontsize=8)
    axes[0].set_ylabel("latitude", fontsize=8)
    axes[0].set_title(f"{lat.size:,} users, {len(regions)} recent cloaked regions", fontsize=9)
    side_km = 2 * zoom_half_m / 1000
    axes[1].set_title(f"zoom: {side_km:.1f} km × {side_km:.1f} km", fontsize=9)
    if zoom is not full:
        axes[0].add_patch(
            Rectangle(
                (zoom[0], zoom[1]), zoom[2] - zoom[0], zoom[3] - zoom[1], fill=False, ec="black", lw=0.8, zorder=4
            )
        )
    if mappable is not None:
        fig.colorbar(mappable, ax=list(axes), shrink=0.7, extend="max", label="k achieved (users inside the region)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.text(0.005, 0.005, MAP_CREDIT, fontsize=6, color="#666666")
    _save_palette_png(fig, path, dpi)


def _save_palette_png(fig: Figure, path: Path, dpi: int) -> None:
    """Save as an optimized 256-colour PNG (a street map is a few flat colours: about a third of the RGBA size)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # type: ignore[no-untyped-call]  # matplotlib 3.11: FigureCanvasAgg.draw is unannotated
    buf = canvas.buffer_rgba()  # type: ignore[no-untyped-call]  # matplotlib 3.11: unannotated as well
    rgba = Image.frombuffer("RGBA", canvas.get_width_height(), buf, "raw", "RGBA", 0, 1)
    rgba.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def _log_bins(values: FloatArray, n: int = 40) -> FloatArray | int:
    pos = values[values > 0]
    if pos.size == 0 or float(pos.max()) / float(pos.min()) < 20:
        return n
    out: FloatArray = np.geomspace(float(pos.min()), float(pos.max()) * 1.0001, n + 1)
    return out


def _histogram(
    path: Path,
    values: Sequence[float],
    *,
    xlabel: str,
    title: str,
    marks: Sequence[tuple[float, str, str]] = (),
    integer_bins: bool = False,
    dpi: int = 100,
) -> None:
    """One histogram with labelled vertical marks (value, label, colour); an empty one says so."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=dpi, layout="constrained")
    ax = fig.subplots()
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif integer_bins:
        lo, hi = int(data.min()), int(data.max())
        ax.hist(data, bins=np.arange(lo - 0.5, hi + 1.5, 1.0).tolist(), color="#4c72b0")
    else:
        bins = _log_bins(data)
        ax.hist(data, bins=bins if isinstance(bins, int) else bins.tolist(), color="#4c72b0")
        if not isinstance(bins, int):
            ax.set_xscale("log")
    for value, label, colour in marks:
        ax.axvline(value, color=colour, linestyle="--", linewidth=1.2, label=label)
    if marks:
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("answers")
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=dpi)


def plot_cloak_area(path: Path, area_m2: Sequence[float], *, max_area_m2: float | None = None) -> None:
    """Distribution of the forwarded regions' area (``ok`` answers), median and the profile cap marked."""
    marks: list[tuple[float, str, str]] = []
    med = percentile(area_m2, 50)
    if med is not None:
        marks.append((med, f"median {med / 1e6:.3g} km²", "#dd8452"))
    if max_area_m2 is not None:
        marks.append((max_area_m2, f"max_area_m2 {max_area_m2 / 1e6:g} km²", "#c44e52"))
    _histogram(
        path,
        area_m2,
        xlabel="cloaked region area (m²)",
        title=f"Cloak area of {len(area_m2):,} answered queries",
        marks=marks,
    )


REQUESTED_K_COLOURS: Final = ("#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3")
"""One colour per requested k on ``achieved_k.png`` (the mean is orange, the bars blue)."""


def plot_achieved_k(path: Path, k_achieved: Sequence[int], *, requested_k: Sequence[int] = ()) -> None:
    """Distribution of ``k_achieved`` (``ok`` answers), the requested k of the profile mix marked."""
    marks: list[tuple[float, str, str]] = [
        (float(k), f"k = {k} requested", REQUESTED_K_COLOURS[i % len(REQUESTED_K_COLOURS)])
        for i, k in enumerate(sorted(set(requested_k)))
    ]
    if k_achieved:
        mean = float(np.mean(k_achieved))
        marks.append((mean, f"mean {mean:.1f}", "#dd8452"))
    _histogram(
        path,
        [float(k) for k in k_achieved],
        xlabel="k achieved (present users inside the region, querier included)",
        title=f"Achieved k of {len(k_achieved):,} answered queries",
        marks=marks,
        integer_bins=True,
    )


def plot_latency(path: Path, latency_s: Sequence[float]) -> None:
    """Distribution of the client's query → answer latency, p50 and p99 marked."""
    ms = [s * 1000.0 for s in latency_s]
    marks: list[tuple[float, str, str]] = []
    for q, colour in ((50, "#dd8452"), (99, "#c44e52")):
        v = percentile(ms, q)
        if v is not None:
            marks.append((v, f"p{q} {v:.1f} ms", colour))
    _histogram(path, ms, xlabel="query → answer latency (ms)", title=f"Latency of {len(ms):,} answers", marks=marks)


def load_plotting() -> None:
    """Import what the pictures need (about a second), e.g. in a worker thread while a run goes on.

    Raises :class:`~kcloak.core.extras.MissingExtra` without the ``report`` extra."""
    require_pictures()
    import matplotlib.backends.backend_agg
    import matplotlib.collections
    import matplotlib.colors
    import matplotlib.figure
    import matplotlib.patches
    import matplotlib.path  # noqa: F401
    from PIL import Image  # noqa: F401


def write_summary(path: Path, summary: Mapping[str, Any]) -> None:
    """``summary.json`` written atomically (temp file + rename), strict JSON (no NaN)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_report(
    directory: Path,
    obs: Observations,
    summary: Mapping[str, Any],
    *,
    streets: StreetGraph | None = None,
    max_area_m2: float | None = None,
    requested_k: Sequence[int] = (),
    map_dpi: int = 110,
    pictures: bool = True,
) -> list[Path]:
    """Write ``summary.json`` and (unless ``pictures`` is false) the four pictures into ``directory``
    (created); returns the paths. Pictures need the ``report`` extra (:class:`~kcloak.core.extras.MissingExtra`)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "summary.json", *(directory / name for name in PICTURES)]
    write_summary(paths[0], summary)
    if not pictures:
        return paths[:1]
    require_pictures()
    title = (
        f"kcloak demo: {summary['algorithm']}, {summary['users']:,} users, "
        f"success rate {_percent(summary['success_rate'])}"
    )
    plot_map(paths[1], lat=obs.lat, lon=obs.lon, regions=list(obs.regions), streets=streets, title=title, dpi=map_dpi)
    plot_cloak_area(paths[2], obs.area_m2, max_area_m2=max_area_m2)
    plot_achieved_k(paths[3], obs.k_achieved, requested_k=requested_k)
    plot_latency(paths[4], obs.latency_s)
    return paths


def _percent(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.1f} %"
