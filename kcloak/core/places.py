"""POI files and the places layer (CONCEPTS §1.6; contract §7 "POI files").

One reader for POI files — contract CSV ``poi_id,lat,lon,category,name`` or a GeoJSON
FeatureCollection of Point features — used by the places layer of ``privacygrid`` and by the
reference LBS. Bad rows (missing or unparsable values, out-of-range coordinates, bad ids or
categories, repeated ``poi_id``) are skipped and counted, never fatal.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kcloak.core.errors import CoreError, InputError

_TEXT_RE = re.compile(r"^[^\x00-\x1f\x7f]{1,64}\Z")
BUNDLED_POIS = "osm_beijing_pois.csv"


class PoiFileError(CoreError, InputError, ValueError):
    """A POI file that cannot be read at all (unreadable, unrecognised, no usable header)."""


@dataclass(frozen=True, slots=True)
class Poi:
    poi_id: str
    lat: float
    lon: float
    category: str
    name: str


@dataclass(frozen=True, slots=True)
class PoiSet:
    """POIs in file order, with numpy columns for vectorized work."""

    pois: tuple[Poi, ...]
    bad_rows: int

    def __len__(self) -> int:
        return len(self.pois)

    @property
    def lat(self) -> npt.NDArray[np.float64]:
        return np.fromiter((p.lat for p in self.pois), np.float64, len(self.pois))

    @property
    def lon(self) -> npt.NDArray[np.float64]:
        return np.fromiter((p.lon for p in self.pois), np.float64, len(self.pois))

    @property
    def categories(self) -> list[str]:
        return [p.category for p in self.pois]


def _valid_text(v: object) -> bool:
    return isinstance(v, str) and bool(_TEXT_RE.match(v))


def _make_poi(poi_id: object, lat: object, lon: object, category: object, name: object) -> Poi | None:
    if not _valid_text(poi_id) or not _valid_text(category):
        return None
    if not isinstance(lat, int | float | str) or not isinstance(lon, int | float | str):
        return None  # JSON and CSV give numbers or text; null, bool (below), lists and objects are bad rows
    try:
        flat = float(lat)
        flon = float(lon)
    except ValueError:
        return None
    if isinstance(lat, bool) or isinstance(lon, bool):
        return None
    if not (math.isfinite(flat) and math.isfinite(flon) and -90 <= flat <= 90 and -180 <= flon <= 180):
        return None
    nm = "" if name is None else name
    if not isinstance(nm, str) or any(ord(c) < 0x20 or ord(c) == 0x7F for c in nm):
        return None
    return Poi(str(poi_id), flat, flon, str(category), nm)


def parse_pois(text: str, *, geojson: bool | None = None) -> PoiSet:
    """Parse POI file contents (CSV, or GeoJSON when it looks like JSON)."""
    if geojson is None:
        geojson = text.lstrip().startswith("{")
    raw: list[tuple[object, object, object, object, object]] = []
    bad = 0
    if geojson:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PoiFileError("POI file: not valid JSON") from exc
        if (
            not isinstance(doc, dict)
            or doc.get("type") != "FeatureCollection"
            or not isinstance(doc.get("features"), list)
        ):
            raise PoiFileError("POI file: expected a GeoJSON FeatureCollection")
        for feat in doc["features"]:
            item = _feature(feat)
            if item is None:
                bad += 1
            else:
                raw.append(item)
    else:
        reader = csv.DictReader(io.StringIO(text))
        header = {h.strip().lower() for h in (reader.fieldnames or [])}
        if not {"poi_id", "lat", "lon", "category"} <= header:
            raise PoiFileError("POI file: CSV header must name poi_id, lat, lon, category (and name)")
        for row in reader:
            r = {(k or "").strip().lower(): v for k, v in row.items()}
            raw.append((r.get("poi_id"), r.get("lat"), r.get("lon"), r.get("category"), r.get("name") or ""))
    seen: set[str] = set()
    out: list[Poi] = []
    for item in raw:
        poi = _make_poi(*item)
        if poi is None or poi.poi_id in seen:
            bad += 1
            continue
        seen.add(poi.poi_id)
        out.append(poi)
    return PoiSet(tuple(out), bad)


def _feature(feat: Any) -> tuple[object, object, object, object, object] | None:
    if not isinstance(feat, dict):
        return None
    geom = feat.get("geometry")
    props = feat.get("properties")
    if not isinstance(geom, dict) or geom.get("type") != "Point" or not isinstance(props, dict):
        return None
    coords = geom.get("coordinates")
    if not isinstance(coords, list) or len(coords) < 2:
        return None
    lon, lat = coords[0], coords[1]
    if not isinstance(lat, (int, float)) or not isinstance(lon, (int, float)):
        return None
    return props.get("poi_id"), lat, lon, props.get("category"), props.get("name", "")


def load_pois(path: str | Path | None = None) -> PoiSet:
    """Read a POI file; ``None`` reads the bundled Beijing POIs (© OpenStreetMap contributors, ODbL)."""
    if path is None:
        text = resources.files("kcloak.cloaking.data").joinpath(BUNDLED_POIS).read_text(encoding="utf-8")
        return parse_pois(text, geojson=False)
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise PoiFileError(f"POI file: cannot read {p.name}") from exc
    return parse_pois(text, geojson=p.suffix.lower() in {".geojson", ".json"} or None)


@dataclass(frozen=True, slots=True)
class PlacesLayer:
    """Static places with categories, for location l-diversity (§1.6): columns plus category codes."""

    lat: npt.NDArray[np.float64]
    lon: npt.NDArray[np.float64]
    category_code: npt.NDArray[np.int64]
    category_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.lat)

    @classmethod
    def from_pois(cls, pois: PoiSet) -> PlacesLayer:
        names = tuple(sorted({p.category for p in pois.pois}))
        code = {c: i for i, c in enumerate(names)}
        return cls(
            lat=pois.lat,
            lon=pois.lon,
            category_code=np.fromiter((code[p.category] for p in pois.pois), np.int64, len(pois)),
            category_names=names,
        )

    @classmethod
    def bundled(cls) -> PlacesLayer:
        return cls.from_pois(load_pois(None))
