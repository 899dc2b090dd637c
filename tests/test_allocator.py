"""The allocator settings of kcloak.core.memory, seen from outside: how much resident memory a child
process gets back after dropping a "view" of large arrays, read from /proc/self/statm."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="mallopt/malloc_trim are glibc's"
)

# A view: 20 arrays of 4 MB, each followed by a long-lived heap block of 64 kB (as the broker's
# allocations between views). One 4 MB array was allocated and freed before, as the previous view's.
_CHILD = r"""
import json, os, sys
import numpy as np
from kcloak.core import memory

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

if sys.argv[1] == "fix":
    assert memory.fix_mmap_threshold() is True
previous = np.ones(1 << 19)
del previous
keep, view = [], []
for _ in range(20):
    view.append(np.ones(1 << 19))
    keep.append(np.ones(1 << 13))
held = rss()
view.clear()
if sys.argv[1] == "trim":
    memory.release_free_memory()
print(json.dumps({"released_mb": (held - rss()) / 1e6}))
"""


def _released_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return float(json.loads(out.stdout)["released_mb"])


def test_without_a_fixed_threshold_freed_view_arrays_stay_resident() -> None:
    # the behaviour the module exists for: glibc's adaptive threshold put the arrays on the heap
    assert _released_mb("none") < 20


def test_a_fixed_mmap_threshold_returns_freed_view_arrays() -> None:
    assert _released_mb("fix") > 70  # the view held 84 MB


def test_malloc_trim_returns_freed_view_arrays() -> None:
    assert _released_mb("trim") > 70
