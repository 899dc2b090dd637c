"""The broker gives freed memory back to the system (kcloak.broker.memory), seen from /proc.

Each case runs in a fresh interpreter: blocks of 64 KiB (under the fixed mmap threshold, so from a
malloc arena, as SQLite's and the windows' buffers are) are written by a thread, all but every
50th is freed (the survivors pin the arena, so glibc's own trimming of its top cannot return the
rest), and the process's anonymous RSS is read from /proc/self/status before and after.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="malloc_trim and mallopt are glibc's"
)

SCRIPT = """
import json, sys, threading
from kcloak.broker.memory import tune_allocator
from kcloak.core.memory import release_free_memory

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

tuned = tune_allocator()
kept = []
def work():
    blocks = [b"x" * 65536 for _ in range(1600)]  # 100 MiB, each page written
    kept.extend(blocks[::50])
before = anon_kib()
t = threading.Thread(target=work)
t.start()
t.join()
freed = anon_kib()
trimmed = release_free_memory() if sys.argv[1] == "trim" else False
after = anon_kib()
print(json.dumps({"tuned": tuned, "trimmed": trimmed, "held_mib": (freed - before) / 1024,
                  "after_mib": (after - before) / 1024}))
"""


def _run(mode: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, timeout=60)
    result: dict[str, float] = json.loads(out.stdout)
    return result


def test_trim_returns_what_the_allocator_kept() -> None:
    kept = _run("keep")
    trimmed = _run("trim")
    assert kept["tuned"] and trimmed["tuned"]
    # Without a trim glibc keeps the freed 98 MiB resident (what the soak saw grow) ...
    assert kept["after_mib"] > 60, kept
    # ... and malloc_trim(0) gives it back: only the 2 MiB still referenced (and some slack) stays.
    assert trimmed["trimmed"] and trimmed["held_mib"] > 60, trimmed
    assert trimmed["after_mib"] < 15, trimmed
