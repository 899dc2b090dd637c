"""OSM street graphs and street movement: parser counts, one-way, components, routes, users on edges."""

from __future__ import annotations

import io
import zipfile
from importlib import resources
from itertools import pairwise
from xml.etree import ElementTree as ET

import numpy as np
import pytest

from kcloak.core.geometry import haversine_m_array
from kcloak.simulators.streets import (
    NOT_ROUTABLE,
    SPEED_KMH,
    OsmFileError,
    RouteTable,
    StreetGraph,
    StreetMovement,
    load_street_graph,
    parse_osm,
)

TINY = b"""<?xml version="1.0" encoding="UTF-8"?>
<osm version="0.6">
 <node id="1" lat="40.000" lon="116.000"/>
 <node id="2" lat="40.000" lon="116.001"/>
 <node id="3" lat="40.001" lon="116.001"/>
 <node id="4" lat="40.001" lon="116.000"/>
 <node id="5" lat="40.002" lon="116.000"/>
 <node id="6" lat="40.005" lon="116.005"/>
 <node id="7" lat="40.006" lon="116.006"/>
 <node id="8" lat="40.000" lon="115.999"/>
 <way id="1"><nd ref="1"/><nd ref="2"/><nd ref="3"/><tag k="highway" v="residential"/></way>
 <way id="2"><nd ref="3"/><nd ref="4"/><nd ref="1"/><tag k="highway" v="primary"/><tag k="oneway" v="yes"/></way>
 <way id="3"><nd ref="4"/><nd ref="5"/><tag k="highway" v="service"/><tag k="oneway" v="yes"/></way>
 <way id="4"><nd ref="1"/><nd ref="6"/><nd ref="3"/><tag k="building" v="yes"/></way>
 <way id="5"><nd ref="2"/><nd ref="4"/><tag k="highway" v="construction"/></way>
 <way id="6"><nd ref="2"/><nd ref="999"/><tag k="highway" v="residential"/></way>
 <way id="7"><nd ref="1"/><nd ref="4"/><tag k="highway" v="footway"/></way>
 <way id="8"><nd ref="8"/><nd ref="1"/><tag k="highway" v="tertiary"/><tag k="oneway" v="-1"/></way>
 <relation id="1"><member type="way" ref="1" role=""/></relation>
</osm>
"""

LINE = b"""<?xml version="1.0" encoding="UTF-8"?>
<osm version="0.6">
 <node id="10" lat="40.000" lon="116.000"/>
 <node id="11" lat="40.010" lon="116.000"/>
 <way id="1"><nd ref="10"/><nd ref="11"/><tag k="highway" v="residential"/></way>
</osm>
"""


def _pairs(graph: StreetGraph) -> set[tuple[int, int]]:
    return set(zip(graph.node_id[graph.tail].tolist(), graph.node_id[graph.head].tolist(), strict=True))


@pytest.fixture(scope="module")
def beijing_raw() -> StreetGraph:
    return parse_osm(io.BytesIO(_bundled_xml()))


@pytest.fixture(scope="module")
def beijing() -> StreetGraph:
    return load_street_graph()


def _bundled_xml() -> bytes:
    data = resources.files("kcloak.simulators.data").joinpath("osm_beijing_sample.osm.zip").read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.read("osm_beijing_sample.osm")


def test_tiny_file_exact_graph() -> None:
    raw = parse_osm(io.BytesIO(TINY))
    assert raw.ways_read == 8
    assert raw.ways_used == 5  # residential, primary, service, footway, tertiary; not building/construction/dangling
    assert sorted(raw.node_id.tolist()) == [1, 2, 3, 4, 5, 8]
    assert _pairs(raw) == {
        (1, 2), (2, 1), (2, 3), (3, 2),  # two-way residential
        (3, 4), (4, 1),  # oneway=yes primary
        (4, 5),  # oneway=yes service
        (1, 4), (4, 1),  # footway (4→1 kept once: the faster primary)
        (1, 8),  # oneway=-1: against the node order
    }  # fmt: skip
    e41 = int(raw.edge_index([np.flatnonzero(raw.node_id == 4)[0]], [np.flatnonzero(raw.node_id == 1)[0]])[0])
    assert raw.highway[raw.edge_class[e41]] == "primary"
    assert raw.speed_mps[e41] == pytest.approx(SPEED_KMH["primary"] / 3.6)
    lengths = haversine_m_array(raw.lat[raw.tail], raw.lon[raw.tail], raw.lat[raw.head], raw.lon[raw.head])
    assert np.array_equal(raw.length_m, lengths)

    scc = raw.largest_component()
    assert sorted(scc.node_id.tolist()) == [1, 2, 3, 4]  # 5 and 8 are dead ends of one-way streets
    assert _pairs(scc) == {(1, 2), (2, 1), (2, 3), (3, 2), (3, 4), (4, 1), (1, 4)}


def test_routes_follow_fastest_path() -> None:
    # 1→4: the footway is 111 m at 5 km/h (80 s); 1→2→3→4 is 281 m by car (≈ 29 s) and wins.
    graph = parse_osm(io.BytesIO(TINY)).largest_component()
    idx = {int(nid): i for i, nid in enumerate(graph.node_id)}
    routes = RouteTable.build(graph, [idx[4]])
    hops = []
    node = idx[1]
    while node != idx[4]:
        edge = int(routes.next_edge[0, node])
        node = int(graph.head[edge])
        hops.append(int(graph.node_id[node]))
    assert hops == [2, 3, 4]
    assert routes.next_edge[0, idx[4]] == -1


def test_bad_files() -> None:
    with pytest.raises(OsmFileError):
        parse_osm(io.BytesIO(b"<osm><node id='1' lat='1' lon='1'/>"))
    with pytest.raises(OsmFileError):
        parse_osm(io.BytesIO(b"<osm><node id='1' lat='1' lon='1'/></osm>"))
    with pytest.raises(OsmFileError):
        parse_osm(io.BytesIO(b"<gpx></gpx>"))
    with pytest.raises(ValueError):
        RouteTable.build(parse_osm(io.BytesIO(TINY)), [0])  # not strongly connected


def test_bundled_file_counts(beijing_raw: StreetGraph, beijing: StreetGraph) -> None:
    # ATTRIBUTION: 74,277 nodes and 19,192 ways, all highway, none in NOT_ROUTABLE, every ref resolves.
    assert beijing_raw.nodes == 74_277
    assert beijing_raw.ways_read == beijing_raw.ways_used == 19_192
    assert set(beijing_raw.highway) <= set(SPEED_KMH) | {"access_ramp"}
    assert not set(beijing_raw.highway) & NOT_ROUTABLE
    assert 0.9 * beijing_raw.nodes < beijing.nodes < beijing_raw.nodes
    assert beijing.edges > beijing.nodes
    assert 1.0 < float(np.median(beijing.length_m)) < 500.0


def test_bundled_file_edges_rederived(beijing_raw: StreetGraph) -> None:
    # Independent re-derivation of the directed node pairs with a whole-file ElementTree parse.
    root = ET.fromstring(_bundled_xml())
    expected: set[tuple[int, int]] = set()
    oneway_ways = 0
    for way in root.iter("way"):
        tags = {t.get("k"): t.get("v") for t in way.iter("tag")}
        assert "highway" in tags
        refs = [int(nd.get("ref", "0")) for nd in way.iter("nd")]
        oneway = tags.get("oneway") == "yes"
        oneway_ways += oneway
        for a, b in pairwise(refs):
            if a != b:
                expected.add((a, b))
                if not oneway:
                    expected.add((b, a))
    assert oneway_ways == 10_094
    assert _pairs(beijing_raw) == expected


def test_users_stay_on_edges_and_under_speed(beijing: StreetGraph) -> None:
    model = StreetMovement(300, beijing, destinations=8, seed=4)
    vmax = float(beijing.speed_mps.max())  # speed factor ≤ 1
    a_lat, a_lon = beijing.lat[beijing.tail], beijing.lon[beijing.tail]
    b_lat, b_lon = beijing.lat[beijing.head], beijing.lon[beijing.head]
    seg_lat, seg_lon = b_lat - a_lat, b_lon - a_lon
    seg2 = seg_lat**2 + seg_lon**2
    lat, lon = model.positions()
    for dt in (1.0, 1.0, 10.0, 1.0, 60.0):
        speed, edge = model.user_speed_mps, model.current_edges
        model.step(dt)
        lat2, lon2 = model.positions()
        # Interpolating in degrees bends lengths by < 1e-4 relative over a Beijing edge (4.3e-5 seen).
        moved = haversine_m_array(lat, lon, lat2, lon2)
        assert moved.max() <= vmax * dt * (1 + 1e-4)
        same = model.current_edges == edge
        assert same.any()
        assert np.all(moved[same] <= speed[same] * dt * (1 + 1e-4))
        lat, lon = lat2, lon2
    for p_lat, p_lon in zip(lat[:100], lon[:100], strict=True):
        t = np.clip(((p_lat - a_lat) * seg_lat + (p_lon - a_lon) * seg_lon) / np.where(seg2 > 0, seg2, 1.0), 0, 1)
        gap = np.hypot(a_lat + t * seg_lat - p_lat, a_lon + t * seg_lon - p_lon)
        assert np.min(gap / np.maximum(np.sqrt(seg2), 1e-12)) <= 1e-6


def test_movement_along_a_meridian_is_exact() -> None:
    # One 1112 m two-way residential street on a meridian (haversine is linear in latitude there).
    graph = parse_osm(io.BytesIO(LINE)).largest_component()
    model = StreetMovement(50, graph, destinations=2, speed_factor=(1.0, 1.0), seed=1)
    v = SPEED_KMH["residential"] / 3.6
    length = float(graph.length_m[0])
    lat, lon = model.positions()
    full = 0
    for _ in range(400):
        model.step(1.0)
        lat2, lon2 = model.positions()
        assert np.all(lon2 == 116.0) and np.all((lat2 >= 40.0) & (lat2 <= 40.01))
        moved = haversine_m_array(lat, lon, lat2, lon2)
        assert moved.max() <= v * (1 + 1e-9)
        full += int(np.sum(np.abs(moved - v) <= 1e-6 * v))
        lat, lon = lat2, lon2
    # A step not touching an end covers exactly v·dt; ends are reached every length/v ≈ 133 s.
    assert full >= 50 * 400 * (1 - 2 / (length / v))


def test_street_determinism(beijing: StreetGraph) -> None:
    routes = RouteTable.sample(beijing, 4, seed=0)
    runs = []
    for seed in (3, 3, 4):
        model = StreetMovement(500, beijing, routes=routes, seed=seed)
        for dt in (1.0, 5.0, 0.5):
            model.step(dt)
        runs.append(np.concatenate(model.positions()))
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_users_reach_destinations_and_pick_new_ones() -> None:
    graph = parse_osm(io.BytesIO(TINY)).largest_component()
    model = StreetMovement(40, graph, destinations=4, seed=2)
    seen = np.zeros(graph.edges, dtype=bool)
    for _ in range(300):
        model.step(5.0)
        seen[model.current_edges] = True
    assert seen.all()  # with every node a destination, every street gets used
