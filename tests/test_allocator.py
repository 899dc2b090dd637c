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


# A server connection reads what arrives, one recv per readiness; with the broker's allocator
# settings, ten reads held must not be ten mappings of their own (glibc's mallinfo2().hblks):
# kcloak's server transports read at most SOCKET_READ_BYTES at a time, asyncio's default
# (256 KiB, above the 128 KiB threshold) is the control.
_SERVER_READS = r"""
import asyncio, ctypes, json, sys
from kcloak.broker.memory import tune_allocator
from kcloak.core.memory import bound_socket_reads

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None))
    sys.exit(0)
libc.mallinfo2.restype = MallInfo2
assert tune_allocator() is True
bound = sys.argv[1] == "bound"
held = []

class Keep(asyncio.Protocol):
    def connection_made(self, transport):
        if bound:
            assert bound_socket_reads(transport)
    def data_received(self, data):
        held.append(data)

async def main():
    server = await asyncio.get_running_loop().create_server(Keep, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(0.05)
    before = libc.mallinfo2().hblks
    for _ in range(10):
        n = len(held)
        writer.write(b'{"t": 1700000000.5, "lat": 37.7749, "lon": -122.4194}')
        await writer.drain()
        while len(held) == n:
            await asyncio.sleep(0.001)
    mapped = libc.mallinfo2().hblks - before
    writer.close()
    server.close()
    print(json.dumps({"mapped": mapped, "reads": len(held)}))

asyncio.run(main())
"""


def _mapped_server_reads(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _SERVER_READS, mode], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(out.stdout)
    if result is None:
        pytest.skip("this glibc has no mallinfo2 (2.33 or later)")
    assert result["reads"] == 10
    return int(result["mapped"])


def test_bounded_server_reads_are_not_mapped_one_by_one() -> None:
    assert _mapped_server_reads("bound") == 0


def test_asyncio_default_reads_are_mapped_one_by_one_under_the_brokers_threshold() -> None:
    assert _mapped_server_reads("default") == 10
