"""Street networks from OSM XML and vectorized movement along them (issue 5; contract §9 ``simulate --osm``).

:func:`parse_osm` streams an OSM XML file (plain, or the first ``.osm`` member of a zip) with
``ElementTree.iterparse`` and turns its routable ``highway=*`` ways into a directed graph: one edge
per consecutive node pair of a way, in both directions unless the way is one-way, with its
great-circle length (contract sphere, §0) and a speed by highway class (:data:`SPEED_KMH`).
:func:`load_street_graph` keeps the largest strongly connected component, so every node can reach
every other. :class:`StreetMovement` moves users along fastest routes (travel time = length /
class speed) towards a sample of destination nodes, all users at once.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import IO, Any
from xml.etree import ElementTree as ET

import numpy as np
import numpy.typing as npt
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components, dijkstra

from kcloak.core.errors import InputError
from kcloak.core.geometry import haversine_m_array
from kcloak.simulators.errors import SimulatorError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

BUNDLED_OSM = "osm_beijing_sample.osm.zip"
"""The bundled Beijing road network (© OpenStreetMap contributors, ODbL 1.0; see ``simulators/data``)."""

SPEED_KMH: Mapping[str, float] = {
    "motorway": 80.0,
    "motorway_link": 50.0,
    "trunk": 70.0,
    "trunk_link": 40.0,
    "primary": 60.0,
    "primary_link": 40.0,
    "secondary": 50.0,
    "secondary_link": 30.0,
    "tertiary": 40.0,
    "tertiary_link": 30.0,
    "unclassified": 30.0,
    "residential": 30.0,
    "road": 30.0,
    "bus_guideway": 30.0,
    "living_street": 15.0,
    "service": 15.0,
    "track": 15.0,
    "cycleway": 15.0,
    "pedestrian": 5.0,
    "footway": 5.0,
    "path": 5.0,
    "bridleway": 5.0,
    "steps": 3.0,
}
"""Default travel speed by ``highway`` class in km/h (urban traffic, not legal limits; ``maxspeed`` is ignored)."""

DEFAULT_SPEED_KMH = 20.0
"""Speed of a routable ``highway`` value missing from :data:`SPEED_KMH` (e.g. ``access_ramp``)."""

NOT_ROUTABLE = frozenset(
    {
        "proposed",
        "construction",
        "abandoned",
        "disused",
        "razed",
        "platform",
        "bus_stop",
        "elevator",
        "rest_area",
        "services",
        "emergency_access_point",
        "corridor",
        "no",
    }
)
"""``highway`` values that are not ways one can travel on; such ways are skipped."""

_ONEWAY_FORWARD = frozenset({"yes", "true", "1"})
_ONEWAY_BACKWARD = frozenset({"-1", "reverse"})
_ONEWAY_NO = frozenset({"no", "false", "0"})


class OsmFileError(SimulatorError, InputError, ValueError):
    """An OSM file that cannot be used at all (unreadable, not OSM XML, no routable highway way)."""


@dataclass(frozen=True, slots=True)
class StreetGraph:
    """A directed street graph: node columns, edge columns sorted by ``(tail, head)``, one edge per pair.

    ``highway`` names the classes that ``edge_class`` indexes. ``ways_read`` counts every ``<way>``
    of the file, ``ways_used`` the routable highway ways that produced edges.
    """

    node_id: IntArray
    lat: FloatArray
    lon: FloatArray
    tail: IntArray
    head: IntArray
    length_m: FloatArray
    speed_mps: FloatArray
    edge_class: npt.NDArray[np.int16]
    highway: tuple[str, ...]
    ways_read: int
    ways_used: int

    @property
    def nodes(self) -> int:
        return int(self.lat.size)

    @property
    def edges(self) -> int:
        return int(self.tail.size)

    @property
    def travel_time_s(self) -> FloatArray:
        out: FloatArray = self.length_m / self.speed_mps
        return out

    def edge_index(self, tail: npt.ArrayLike, head: npt.ArrayLike) -> IntArray:
        """Index of the edge ``tail → head`` for each pair, ``-1`` where there is none."""
        t = np.asarray(tail, dtype=np.int64)
        h = np.asarray(head, dtype=np.int64)
        keys = self.tail * self.nodes + self.head
        want = t * self.nodes + h
        if keys.size == 0:
            return np.full(want.shape, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(keys, want), keys.size - 1)
        found = (t >= 0) & (h >= 0) & (keys[pos] == want)
        out: IntArray = np.where(found, pos, -1).astype(np.int64)
        return out

    def subgraph(self, keep_nodes: npt.NDArray[np.bool_]) -> StreetGraph:
        """The graph induced by the nodes where ``keep_nodes`` is true (node order kept)."""
        new_index = np.cumsum(keep_nodes, dtype=np.int64) - 1
        keep_edges = keep_nodes[self.tail] & keep_nodes[self.head]
        return StreetGraph(
            node_id=self.node_id[keep_nodes],
            lat=self.lat[keep_nodes],
            lon=self.lon[keep_nodes],
            tail=new_index[self.tail[keep_edges]],
            head=new_index[self.head[keep_edges]],
            length_m=self.length_m[keep_edges],
            speed_mps=self.speed_mps[keep_edges],
            edge_class=self.edge_class[keep_edges],
            highway=self.highway,
            ways_read=self.ways_read,
            ways_used=self.ways_used,
        )

    def largest_component(self) -> StreetGraph:
        """The largest strongly connected component (ties: the one holding the lowest node index)."""
        if self.nodes == 0:
            return self
        matrix = csr_matrix((np.ones(self.edges), (self.tail, self.head)), shape=(self.nodes, self.nodes))
        _, labels = connected_components(matrix, directed=True, connection="strong")
        biggest = int(np.argmax(np.bincount(labels)))
        return self.subgraph(labels == biggest)


def _oneway(tags: Mapping[str, str]) -> int:
    """+1 forward only, -1 backward only, 0 both ways (``junction=roundabout`` implies one-way)."""
    value = tags.get("oneway", "").strip().lower()
    if value in _ONEWAY_FORWARD:
        return 1
    if value in _ONEWAY_BACKWARD:
        return -1
    if value in _ONEWAY_NO:
        return 0
    return 1 if tags.get("junction", "") in {"roundabout", "circular"} else 0


def _open_osm(source: str | Path | IO[bytes]) -> tuple[IO[bytes], list[Any]]:
    """A binary stream of OSM XML and the handles to close afterwards."""
    if not isinstance(source, (str, Path)):
        return source, []
    path = Path(source)
    try:
        if zipfile.is_zipfile(path):
            archive = zipfile.ZipFile(path)
            members = [i for i in archive.infolist() if not i.is_dir()]
            osm = [i for i in members if i.filename.lower().endswith(".osm")] or members
            if not osm:
                archive.close()
                raise OsmFileError(f"OSM file: {path.name} is an empty zip")
            stream = archive.open(osm[0])
            return stream, [stream, archive]
        fh = path.open("rb")
        return fh, [fh]
    except OSError as exc:
        raise OsmFileError(f"OSM file: cannot read {path.name}") from exc


def parse_osm(source: str | Path | IO[bytes], *, speeds_kmh: Mapping[str, float] = SPEED_KMH) -> StreetGraph:
    """Stream an OSM XML file (or a zip holding one) into the directed graph of its routable highway ways.

    Every node referenced by a kept way becomes a graph node; consecutive node pairs become edges
    (a pair with a missing node, or a repeated node, is skipped); parallel edges between the same
    two nodes keep only the fastest. Unknown classes travel at :data:`DEFAULT_SPEED_KMH`.
    """
    stream, handles = _open_osm(source)
    node_index: dict[int, int] = {}
    node_ids: list[int] = []
    lats: list[float] = []
    lons: list[float] = []
    classes: dict[str, int] = {}
    tails: list[int] = []
    heads: list[int] = []
    edge_cls: list[int] = []
    ways_read = ways_used = 0
    last_tag = ""
    try:
        for _, elem in ET.iterparse(stream, events=("end",)):
            tag = last_tag = elem.tag
            if tag == "node":
                try:
                    nid, lat, lon = int(elem.attrib["id"]), float(elem.attrib["lat"]), float(elem.attrib["lon"])
                except (KeyError, ValueError):
                    elem.clear()
                    continue
                if -90.0 <= lat <= 90.0 and -180.0 <= lon <= 180.0 and nid not in node_index:
                    node_index[nid] = len(node_ids)
                    node_ids.append(nid)
                    lats.append(lat)
                    lons.append(lon)
                elem.clear()
            elif tag == "way":
                ways_read += 1
                tags = {t.get("k", ""): t.get("v", "") for t in elem.iter("tag")}
                highway = tags.get("highway")
                if highway and highway not in NOT_ROUTABLE:
                    refs = [node_index.get(int(nd.get("ref", "0")), -1) for nd in elem.iter("nd")]
                    direction = _oneway(tags)
                    code = classes.setdefault(highway, len(classes))
                    added = False
                    for a, b in pairwise(refs):
                        if a < 0 or b < 0 or a == b:
                            continue
                        added = True
                        if direction >= 0:
                            tails.append(a)
                            heads.append(b)
                            edge_cls.append(code)
                        if direction <= 0:
                            tails.append(b)
                            heads.append(a)
                            edge_cls.append(code)
                    ways_used += added
                elem.clear()
            elif tag == "relation":
                elem.clear()
    except (ET.ParseError, ValueError) as exc:
        raise OsmFileError(f"OSM file: not readable OSM XML ({exc})") from exc
    finally:
        for handle in handles:
            handle.close()
    if last_tag != "osm":
        raise OsmFileError("OSM file: the root element is not <osm>")
    if not tails:
        raise OsmFileError("OSM file: no routable highway way")
    highway = tuple(sorted(classes, key=classes.__getitem__))
    class_speed = np.array([speeds_kmh.get(h, DEFAULT_SPEED_KMH) for h in highway], dtype=np.float64) / 3.6
    if np.any(~np.isfinite(class_speed) | (class_speed <= 0)):
        raise ValueError("speeds_kmh: speeds must be finite and > 0")
    t_all = np.asarray(tails, dtype=np.int64)
    h_all = np.asarray(heads, dtype=np.int64)
    used, compact = np.unique(np.concatenate([t_all, h_all]), return_inverse=True)
    tail, head = compact[: t_all.size], compact[t_all.size :]
    lat = np.asarray(lats, dtype=np.float64)[used]
    lon = np.asarray(lons, dtype=np.float64)[used]
    cls = np.asarray(edge_cls, dtype=np.int16)
    speed = class_speed[cls]
    length = haversine_m_array(lat[tail], lon[tail], lat[head], lon[head])
    # One edge per (tail, head): the fastest of any parallel ways.
    order = np.lexsort((length / speed, head, tail))
    tail, head, cls, speed, length = tail[order], head[order], cls[order], speed[order], length[order]
    first = np.ones(tail.size, dtype=bool)
    first[1:] = (tail[1:] != tail[:-1]) | (head[1:] != head[:-1])
    return StreetGraph(
        node_id=np.asarray(node_ids, dtype=np.int64)[used],
        lat=lat,
        lon=lon,
        tail=tail[first],
        head=head[first],
        length_m=length[first],
        speed_mps=speed[first],
        edge_class=cls[first],
        highway=highway,
        ways_read=ways_read,
        ways_used=ways_used,
    )


def load_street_graph(path: str | Path | None = None, *, largest_component: bool = True) -> StreetGraph:
    """Read an OSM file (``None``: the bundled Beijing sample) and keep its largest strongly connected component."""
    if path is None:
        data = resources.files("kcloak.simulators.data").joinpath(BUNDLED_OSM).read_bytes()
        graph = parse_osm(_first_member(data))
    else:
        graph = parse_osm(path)
    return graph.largest_component() if largest_component else graph


def _first_member(zip_bytes: bytes) -> IO[bytes]:
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as archive:
        name = next(n for n in archive.namelist() if n.lower().endswith(".osm"))
        return io.BytesIO(archive.read(name))


@dataclass(frozen=True, slots=True)
class RouteTable:
    """Fastest-route trees towards a few destination nodes: ``next_edge[d, v]`` leaves ``v`` towards ``dest_node[d]``.

    ``next_edge[d, dest_node[d]]`` is ``-1``. Built with one Dijkstra per destination on the reversed
    graph (``scipy.sparse.csgraph``), so every route is a fastest path of the graph.
    """

    dest_node: IntArray
    next_edge: npt.NDArray[np.int32]

    @classmethod
    def build(cls, graph: StreetGraph, dest_node: npt.ArrayLike) -> RouteTable:
        """Trees towards the given nodes; raises ``ValueError`` if some node cannot reach one of them."""
        dest = np.asarray(dest_node, dtype=np.int64)
        n = graph.nodes
        if dest.ndim != 1 or dest.size == 0 or np.any((dest < 0) | (dest >= n)):
            raise ValueError("dest_node: need node indices of the graph")
        # Zero-length edges (distinct nodes at one position) get a tiny weight: csgraph may drop zeros.
        weight = np.maximum(graph.travel_time_s, 1e-9)
        reverse = csr_matrix((weight, (graph.head, graph.tail)), shape=(n, n))
        next_edge = np.empty((dest.size, n), dtype=np.int32)
        nodes = np.arange(n, dtype=np.int64)
        for lo in range(0, dest.size, 16):
            chunk = dest[lo : lo + 16]
            _, pred = dijkstra(reverse, directed=True, indices=chunk, return_predecessors=True)
            for j, d in enumerate(chunk):
                nxt = graph.edge_index(nodes, pred[j])
                nxt[d] = -1
                if np.count_nonzero(nxt < 0) > 1:
                    raise ValueError("graph: some node cannot reach a destination (use largest_component())")
                next_edge[lo + j] = nxt
        return cls(dest_node=dest, next_edge=next_edge)

    @classmethod
    def sample(cls, graph: StreetGraph, destinations: int, *, seed: int | None = 0) -> RouteTable:
        """Trees towards ``destinations`` distinct nodes drawn uniformly (all nodes if there are fewer)."""
        if destinations < 2 or graph.nodes < 2:
            raise ValueError("destinations: need at least 2 destinations and 2 nodes")
        rng = np.random.default_rng(seed)
        m = min(destinations, graph.nodes)
        return cls.build(graph, np.sort(rng.choice(graph.nodes, size=m, replace=False)))


class StreetMovement:
    """Users driving along the street graph: fastest route to a random destination, then a new one.

    Each user holds its current edge, its offset along it (m) and a destination among the route
    table's nodes; a step advances every user by ``edge speed × its speed factor × dt``, crossing as
    many edges as the time allows (at most ``max_edges_per_step``; time beyond is dropped, which only
    a chain of zero-length edges could cause). Users start uniformly along the streets (edge chosen
    in proportion to its length). Positions interpolate linearly in lat/lon along the edge, so every
    position lies on a segment of the graph.

    Keyword-only parameters:
        destinations: number of destination nodes sampled for the route table; default ``64``.
        routes: a prebuilt :class:`RouteTable` (shared between models); default ``None`` (sample one).
        speed_factor: ``(min, max)`` per-user multiplier of the class speeds; default ``(0.7, 1.0)``.
        max_edges_per_step: cap on edges crossed by one user in one step; default ``256``.
        seed: seed of the model's ``numpy.random.Generator`` (also samples the destinations); default ``0``.
    """

    def __init__(
        self,
        n: int,
        graph: StreetGraph,
        *,
        destinations: int = 64,
        routes: RouteTable | None = None,
        speed_factor: tuple[float, float] = (0.7, 1.0),
        max_edges_per_step: int = 256,
        seed: int | None = 0,
    ) -> None:
        if n < 0:
            raise ValueError("users: must be >= 0")
        lo, hi = float(speed_factor[0]), float(speed_factor[1])
        if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo <= hi):
            raise ValueError("speed_factor: need finite 0 < min <= max")
        if max_edges_per_step < 1:
            raise ValueError("max_edges_per_step: must be >= 1")
        self._rng = np.random.default_rng(seed)
        self.graph = graph
        self.routes = routes if routes is not None else RouteTable.sample(graph, destinations, seed=seed)
        if self.routes.next_edge.shape[1] != graph.nodes:
            raise ValueError("routes: built for another graph")
        self.max_edges_per_step = int(max_edges_per_step)
        self._n = int(n)
        self._len = graph.length_m
        self._speed = graph.speed_mps
        self._head = graph.head
        self._lat0 = graph.lat[graph.tail]
        self._lon0 = graph.lon[graph.tail]
        self._dlat = graph.lat[graph.head] - self._lat0
        self._dlon = graph.lon[graph.head] - self._lon0
        self._inv_len = np.divide(1.0, self._len, out=np.zeros_like(self._len), where=self._len > 0)
        self._n_dest = int(self.routes.dest_node.size)
        total = float(self._len.sum())
        if total > 0:
            cum = np.cumsum(self._len)
            picks = np.searchsorted(cum, self._rng.uniform(0.0, total, n), side="right")
            self._edge = np.minimum(picks, graph.edges - 1)
        else:
            self._edge = self._rng.integers(0, graph.edges, n)
        self._offset = self._rng.uniform(0.0, 1.0, n) * self._len[self._edge]
        self._dest = self._rng.integers(0, self._n_dest, n)
        self._factor = self._rng.uniform(lo, hi, n) if hi > lo else np.full(n, lo)

    @property
    def users(self) -> int:
        return self._n

    @property
    def current_edges(self) -> IntArray:
        """Edge index of every user (a copy)."""
        return self._edge.copy()

    @property
    def user_speed_mps(self) -> FloatArray:
        """Every user's current speed: its edge's class speed times its speed factor."""
        out: FloatArray = self._speed[self._edge] * self._factor
        return out

    def positions(self) -> tuple[FloatArray, FloatArray]:
        e = self._edge
        frac = self._offset * self._inv_len[e]
        np.minimum(frac, 1.0, out=frac)
        lat = self._dlat[e] * frac
        lat += self._lat0[e]
        lon = self._dlon[e] * frac
        lon += self._lon0[e]
        return lat, lon

    def step(self, dt_s: float) -> None:
        """Advance every user by ``dt_s`` seconds along its route (one full pass, then passes over edge crossers)."""
        if not (math.isfinite(dt_s) and dt_s >= 0.0):
            raise ValueError("dt_s: must be finite and >= 0")
        if self._n == 0 or dt_s == 0.0:
            return
        e = self._edge
        speed = self._speed[e]
        speed *= self._factor
        need = self._len[e] - self._offset
        need /= speed
        speed *= dt_s
        self._offset += speed
        rows = np.flatnonzero(need <= dt_s)
        left = dt_s - need[rows]
        passes = 0
        while rows.size and passes < self.max_edges_per_step:
            passes += 1
            node = self._head[self._edge[rows]]
            dest = self._dest[rows]
            arrived = self.routes.dest_node[dest] == node
            if arrived.any():
                hop = self._rng.integers(1, self._n_dest, int(arrived.sum()))
                dest[arrived] = (dest[arrived] + hop) % self._n_dest
                self._dest[rows] = dest
            edge = self.routes.next_edge[dest, node].astype(np.int64)
            speed = self._speed[edge] * self._factor[rows]
            need = self._len[edge] / speed
            self._edge[rows] = edge
            self._offset[rows] = speed * left
            cross = need <= left
            rows, left = rows[cross], left[cross] - need[cross]
        if rows.size:
            self._offset[rows] = self._len[self._edge[rows]]
