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


# asyncio's socket transports read with ``recv(max_size)``: a new bytes object of max_size (256 KiB),
# shrunk to what arrived. Ten such reads are held, and glibc's count of blocks mapped on their own
# (mallinfo2().hblks) is read before and after: with the broker's allocator settings none of them
# may be a mapping of its own (each would cost an mmap, a page fault, an mremap and a munmap).
_READS = r"""
import asyncio.selector_events, ctypes, json, socket, sys
from kcloak.broker.memory import tune_allocator
from kcloak.core import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None))
    sys.exit(0)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "broker":
    assert tune_allocator() is True
else:
    assert memory.fix_mmap_threshold(int(sys.argv[1])) is True
max_size = asyncio.selector_events._SelectorSocketTransport.max_size
a, b = socket.socketpair()
before = libc.mallinfo2().hblks
held = []
for i in range(10):
    a.sendall(b'{"t": 1700000000.5, "lat": 37.7749, "lon": -122.4194}')
    held.append(b.recv(max_size))
print(json.dumps({"mapped": libc.mallinfo2().hblks - before, "max_size": max_size}))
"""


def _mapped_reads(setting: str) -> int | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _READS, setting], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    if result is None:
        pytest.skip("this glibc has no mallinfo2 (2.33 or later)")
    return int(result["mapped"])


def test_socket_reads_are_not_mapped_one_by_one_under_the_brokers_settings() -> None:
    assert _mapped_reads("broker") == 0


def test_socket_reads_were_mapped_one_by_one_at_glibcs_initial_threshold() -> None:
    # the condition the threshold was raised for: at 128 KiB every read is a mapping of its own
    assert _mapped_reads(str(128 * 1024)) == 10
