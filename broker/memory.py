"""The broker's memory: the C allocator's settings, giving freed memory back, and diagnostics.

The broker's threads (SQLite writer and readers, ``asyncio.to_thread`` workers) each allocate
from a glibc malloc arena of their own, and glibc keeps what is freed in an arena for reuse instead
of returning it to the system: a soak saw the broker's RSS climb ~2.8 MiB a minute with the Python
heap flat (tracemalloc), and a ``malloc_trim(0)`` given from outside took 100 MiB back at once. A
publication window's columns (hundreds of MiB) went the same way. So, on glibc only (elsewhere both
are no-ops): :func:`tune_allocator` caps the arenas at two and fixes the mmap threshold
(:data:`kcloak.core.memory.MMAP_THRESHOLD`; glibc otherwise raises it up to 32 MiB after a large
free, so the next window's arrays land in the heap and stay there), and :func:`run_trim` calls
``malloc_trim(0)`` every :data:`TRIM_EVERY_S` seconds; publication calls
:func:`~kcloak.core.memory.release_free_memory` after each window.

Diagnostics, off unless ``KCLOAK_MEMDIAG`` names a file: :func:`run_memdiag` starts
:mod:`tracemalloc` (``KCLOAK_MEMDIAG_FRAMES`` frames, 1 by default) and, every
``KCLOAK_MEMDIAG_EVERY_S`` seconds (60), appends to the file the process's RSS (anonymous and
file-backed), the collector's counts and the 25 allocation sites that grew most since the first
dump. Tracing slows the broker several times: a diagnostic, never a production setting.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import tracemalloc
from pathlib import Path

from kcloak.core.memory import cap_arenas, fix_mmap_threshold, is_glibc, release_free_memory

TOP = 25
TRIM_EVERY_S = 30.0
"""How often :func:`run_trim` gives freed memory back."""
ARENA_MAX = 2

log = logging.getLogger("kcloak.memory")


def tune_allocator() -> bool:
    """Cap glibc's arenas and fix its mmap threshold (module docstring); False where not glibc."""
    if not is_glibc():
        return False
    ok = cap_arenas(ARENA_MAX) and fix_mmap_threshold()
    if not ok:
        log.warning("mallopt refused")
    return ok


async def run_trim(every_s: float = TRIM_EVERY_S) -> None:
    """``malloc_trim(0)`` (:func:`~kcloak.core.memory.release_free_memory`) every ``every_s`` seconds until
    cancelled (in a thread: it walks every arena)."""
    if not is_glibc():
        return
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(release_free_memory)


def _rss() -> str:
    """VmRSS and its anonymous and file-backed parts, MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile")))
    return " ".join(f"{k}={int(v.split()[0]) / 1024:.1f}MiB" for k, v in fields.items())


def _write(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


async def run_memdiag() -> None:
    """Dump until cancelled, when ``KCLOAK_MEMDIAG`` is set; return at once otherwise."""
    target = os.environ.get("KCLOAK_MEMDIAG")
    if not target:
        return
    path = Path(target)
    every_s = float(os.environ.get("KCLOAK_MEMDIAG_EVERY_S", "60"))
    tracemalloc.start(int(os.environ.get("KCLOAK_MEMDIAG_FRAMES", "1")))
    t0 = time.monotonic()
    base: tracemalloc.Snapshot | None = None
    while True:
        await asyncio.sleep(every_s)
        snap = await asyncio.to_thread(tracemalloc.take_snapshot)
        traced, peak = tracemalloc.get_traced_memory()
        head = (
            f"== t={time.monotonic() - t0:.0f}s {_rss()} traced={traced / 2**20:.1f}MiB "
            f"peak={peak / 2**20:.1f}MiB gc_count={gc.get_count()} "
            f"gc_collections={[s['collections'] for s in gc.get_stats()]}\n"
        )
        if base is None:
            base = snap
            lines = [str(s) for s in snap.statistics("lineno")[:TOP]]
        else:
            lines = [str(s) for s in snap.compare_to(base, "lineno")[:TOP]]
        _write(path, head + "\n".join(lines) + "\n")
