"""Processes as ``/proc`` shows them, for tests that check what a kcloak process leaves behind."""

from __future__ import annotations

from pathlib import Path


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie has ended; it waits only to be reaped)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every process now whose parent chain leads to ``pid``."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found
