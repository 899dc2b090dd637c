"""The live map in a real headless browser during a real ``kcloak demo`` run.

Debian's ``chromium`` driven by its ``chromedriver`` through Selenium (``scripts/bootstrap --tests``
installs both): the page the demo prints is loaded, regions appear, the counters move, a
screenshot is saved into the test's folder, and the frames the page received hold none of the
coordinates the simulated users sent (at the precision they sent them, 6 decimals) and none of
their user ids. Without chromium the test fails in CI (``CI=true``) and is skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from kcloak.cli._demo_run import DemoConfig, DemoObserver, run_demo
from kcloak.simulators.traffic import simulated_users

USERS = 300
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
# The colours the page draws regions in (by achieved k), to find them in the screenshot.
REGION_COLOURS = ("#c0392b", "#e67e22", "#16a085", "#2c6fbb", "#6c3483")


def _first(paths: tuple[str, ...]) -> str | None:
    return next((p for p in paths if os.access(p, os.X_OK)), None)


def _browser_or_skip() -> tuple[str, str]:
    chromium, driver = _first(CHROMIUM), _first(CHROMEDRIVER)
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if chromium is None or driver is None:
        reason = "needs chromium, chromedriver and selenium (scripts/bootstrap --tests installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return chromium, driver


class RecordingObserver(DemoObserver):
    """The demo's observer, also keeping every coordinate as the clients sent it (``%.6f``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: set[tuple[str, str]] = set()

    def on_positions(self, lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64]) -> None:
        super().on_positions(lat, lon)
        self.sent.update((f"{a:.6f}", f"{b:.6f}") for a, b in zip(lat.tolist(), lon.tolist(), strict=True))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless chromium for the module's tests (Debian's, through its chromedriver)."""
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="kcloak-chromium-")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,800",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _browse(urls: queue.Queue[str], driver: Any, out: Path) -> dict[str, Any]:
    """Wait for the map URL, load it; return what the checks need."""
    from selenium.webdriver.support.ui import WebDriverWait

    url = urls.get(timeout=90)
    driver.get(url)
    wait = WebDriverWait(driver, 30, poll_frequency=0.2)
    wait.until(
        lambda d: d.execute_script("const m = window.kcloakMap; return m && m.last && m.last.regions.rows.length > 0")
    )
    counters = []
    for _ in range(2):
        counters.append(
            {name: driver.find_element("id", name).text for name in ("c-updates", "c-queries", "c-users", "c-p99")}
        )
        time.sleep(3.0)
    # a published window (the test's demo publishes 4 s windows) reaches the panel
    wait.until(lambda d: d.execute_script("return window.kcloakMap.last.windows.recent.length > 0"))
    window_rows = len(driver.find_elements("css selector", "#windows tr"))
    shot = out / "live-map.png"
    driver.save_screenshot(str(shot))
    received = driver.execute_script("return window.kcloakMap.received")
    frames = driver.execute_script("return window.kcloakMap.frames")
    status = driver.find_element("id", "status").text
    streets = driver.execute_script("const s = window.kcloakMap.streets; return s ? s.lines.length : 0")
    return {
        "window_rows": window_rows,
        "streets": streets,
        "url": url,
        "counters": counters,
        "received": received,
        "frames": frames,
        "shot": shot,
        "status": status,
    }


def _numbers(node: Any) -> list[float]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _numbers(v)]
    if isinstance(node, list):
        return [x for v in node for x in _numbers(v)]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [float(node)]
    return []


def _strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [*map(str, node), *(s for v in node.values() for s in _strings(v))]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return [node] if isinstance(node, str) else []


def _count(text: str) -> int:
    return int(text.replace(",", ""))


def _near(rgb: npt.NDArray[np.int16], colour: str) -> npt.NDArray[np.bool_]:
    target = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    near: npt.NDArray[np.bool_] = np.abs(rgb - target).sum(axis=-1) < 45
    return near


def test_live_map_in_a_real_browser(tmp_path: Path, browser: Any) -> None:
    observer = RecordingObserver()
    urls: queue.Queue[str] = queue.Queue()

    def say(message: str) -> None:
        found = re.search(r"live map: (http://127\.0\.0\.1:\d+/map)", message)
        if found:
            urls.put(found.group(1))

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        cfg = DemoConfig(
            users=USERS,
            duration_s=40.0,
            report_dir=tmp_path / "report",
            seed=11,
            publish_window_s=4,  # windows are published while the page is open
            max_update_age_s=3.0,
        )
        demo = asyncio.create_task(run_demo(cfg, stop=stop, say=say, observer=observer))
        try:
            return await asyncio.to_thread(_browse, urls, browser, tmp_path)
        finally:
            stop.set()  # the checks are done: the demo ends and writes its report
            await demo

    seen = asyncio.run(run())
    print(f"live map screenshot: {seen['shot']}")

    # The page loaded from the URL the demo printed, is live, and drew regions.
    assert seen["status"] == "live"
    assert seen["streets"] > 1000  # the demo's streets, drawn under the map
    assert seen["window_rows"] >= 2  # a header and at least one published window
    assert seen["frames"] == len(seen["received"]) >= 3
    frames = [json.loads(raw) for raw in seen["received"]]
    assert any(f["regions"]["rows"] for f in frames)
    assert any(f["density"]["cells"] for f in frames)
    # The counters move: fixes and answers both grew between two readings 3 s apart.
    before, after = seen["counters"]
    assert _count(after["c-updates"]) > _count(before["c-updates"]) > 0
    assert _count(after["c-queries"]) > _count(before["c-queries"])
    assert _count(after["c-users"]) > 0 and after["c-p99"].endswith(" ms")

    # Nothing the clients sent reaches the page: no coordinate (as sent, 6 decimals; a fortiori no
    # pair) and no user id, anywhere in any frame.
    assert len(observer.sent) > USERS
    values = {f"{v:.6f}" for f in frames for v in _numbers(f)}
    sent_values = {c for pair in observer.sent for c in pair}
    assert not values & sent_values
    assert not any(lat in values and lon in values for lat, lon in observer.sent)
    raw = "\n".join(seen["received"])
    ids = simulated_users(USERS, None)
    assert not [u for u in ids if u in raw]
    assert not {s for f in frames for s in _strings(f)} & set(ids)

    # The screenshot shows the regions in their k colours.
    with Image.open(seen["shot"]) as img:
        rgb = np.asarray(img.convert("RGB"), dtype=np.int16)
    assert rgb.shape[0] >= 600 and rgb.shape[1] >= 1000
    coloured = sum(int(_near(rgb, c).sum()) for c in REGION_COLOURS)
    assert coloured > 200, coloured


def test_with_tokens_the_page_shows_data_to_a_map_viewer_only(tmp_path: Path, browser: Any) -> None:
    """With tokens, the page itself loads for anyone but its data only with ``#token=`` of a user in
    ``auth.map_viewers``; the page says why it shows nothing."""
    from selenium.webdriver.support.ui import WebDriverWait

    from kcloak.broker.auth import TokenStore
    from kcloak.broker.config import Config
    from kcloak.broker.service import Broker
    from kcloak.wire.tokens import parse_tokens

    tokens = TokenStore.from_lines(parse_tokens("alice:tok-alice-map\nbob:tok-bob-map\n"))
    cfg = Config().with_values(
        {
            "http.listen": "127.0.0.1:0",
            "mqtt.mode": "none",
            "upstream.url": "http://127.0.0.1:9",
            "storage.data_dir": str(tmp_path / "data"),
            "auth.map_viewers": ["alice"],
        }
    )

    def status_of(url: str) -> tuple[str, int]:
        browser.get("about:blank")  # a new document, not just a new fragment
        browser.get(url)
        wait = WebDriverWait(browser, 15, poll_frequency=0.2)
        wait.until(lambda d: d.find_element("id", "status").text not in ("connecting…", ""))
        if browser.find_element("id", "status").text == "live":
            wait.until(lambda d: d.execute_script("return window.kcloakMap.frames > 0"))
        return browser.find_element("id", "status").text, int(browser.execute_script("return window.kcloakMap.frames"))

    async def run() -> list[tuple[str, int]]:
        async with Broker(config=cfg, tokens=tokens) as broker:
            base = f"http://127.0.0.1:{broker.http_port}/map"
            return [
                await asyncio.to_thread(status_of, url)
                for url in (base, f"{base}#token=tok-bob-map", f"{base}#token=tok-alice-map")
            ]

    nobody, bob, alice = asyncio.run(run())
    assert nobody[0].startswith("no access: a valid bearer token is required") and nobody[1] == 0
    assert bob[0].startswith("no access: not a map viewer") and bob[1] == 0
    assert alice == ("live", alice[1]) and alice[1] >= 1
