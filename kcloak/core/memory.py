"""The process's allocator behaviour, made deterministic from inside (glibc ``mallopt``).

A broker at a million users allocates per view a few dozen numpy arrays of 1–8 MB each and frees
them when the next view replaces it. glibc serves such blocks with ``mmap`` only while they are
above its mmap threshold, and that threshold is *adaptive*: each freed mmapped block raises it
to the block's size (up to 32 MB), after which the same arrays come from the heap, where freed
space between long-lived objects is kept rather than returned. The resident size then grows with
every view (measured: one ``hilbert`` view of 1M users, about 1.1 GB instead of 0.5 GB).

:func:`fix_mmap_threshold` sets the threshold once, which also switches the adaptation off
(the same as the environment variable ``MALLOC_MMAP_THRESHOLD_``, without relying on whoever
starts the process). :func:`release_free_memory` hands freed heap pages back (``malloc_trim``).
Both do nothing, and say so, on a C library that is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform

MMAP_THRESHOLD = 128 * 1024
"""Blocks from this size up are mapped on their own and unmapped when freed (glibc's initial value)."""

_M_MMAP_THRESHOLD = -3  # malloc.h
_M_ARENA_MAX = -8


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (no adaptation). True if set, False if not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(nbytes)))


def is_glibc() -> bool:
    """Whether the process's C library is glibc (the only one these settings apply to)."""
    return _glibc() is not None


def cap_arenas(n: int) -> bool:
    """Cap glibc's malloc arenas at ``n`` (each thread otherwise gets one that keeps what it frees).
    True if set, False if not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(n)))


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (``malloc_trim(0)``). True if any were returned."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))


SOCKET_READ_BYTES = 64 * 1024
"""Most bytes a server connection reads at once (:func:`bound_socket_reads`): below :data:`MMAP_THRESHOLD`.
kcloak's clients read into a buffer of their own instead (:mod:`kcloak.wire.reads`)."""


def bound_socket_reads(transport: object, nbytes: int = SOCKET_READ_BYTES) -> bool:
    """Make ``transport`` read at most ``nbytes`` at a time; True if it could be set.

    asyncio's socket transports read with ``recv(max_size)`` into a new bytes object of ``max_size``
    (256 KiB), then shrink it to what arrived. Above :data:`MMAP_THRESHOLD` each such buffer was a
    mapping of its own: an ``mmap``, a page fault, an ``mremap`` and a ``munmap`` per read whenever
    the heap had no free block that large (measured: HTTP single fixes 12–17k/s, the event loop's
    kernel time 18–36 µs per fix, against 18–19k/s and 6–7 µs without the mappings). A transport
    without that attribute (uvloop's reads into a buffer of its own) is left as it is."""
    if not hasattr(transport, "max_size"):
        return False
    transport.max_size = nbytes
    return True


__all__ = [
    "MMAP_THRESHOLD",
    "SOCKET_READ_BYTES",
    "bound_socket_reads",
    "cap_arenas",
    "fix_mmap_threshold",
    "is_glibc",
    "release_free_memory",
]
