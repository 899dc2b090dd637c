"""Bytes a position index holds per user, measured from outside with tracemalloc.

The design's budget per user (60,000 users, 8-character ids, columns doubled to 65,536 rows): numpy
columns 55 B a row (lat, lon, t, both areas and salt at 8 B, k 4 B, three flags) = 60 B a user; the
user ↔ row map 12 B a row for its ids' start and length, 8 B for the hash, 8 B of id bytes, 4 B a
slot of a table at most half full (≤ 9 B a user); the rows whose profile the next snapshot reads,
8 B; ~37 B in all for the arrays' over-allocation and the small dict of recent users. A ``dict``
of str → int with the strings and a row → user list (what it replaced) cost ~160 B a user more:
the same index measured 194 B a user (this one 109).
"""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

from kcloak.cloaking.index import PositionIndex

USERS = 60_000
BOUND_BYTES_PER_USER = 125


def test_index_bytes_per_user_stay_within_the_design() -> None:
    PositionIndex().update_batch(["warm", "up"], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])  # lazy imports, caches
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PositionIndex(hot_users=1024)
        for start in range(0, USERS, 10_000):
            users = [f"u{i:07d}" for i in range(start, start + 10_000)]
            index.update_batch(users, [39.9] * len(users), [116.4] * len(users), [1.0] * len(users))
            del users
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == USERS
    assert index.row_of("u0059999") is not None
    per_user = held / USERS
    assert per_user <= BOUND_BYTES_PER_USER, f"{per_user:.1f} B per user"


def test_a_serving_broker_does_not_import_what_only_other_commands_need() -> None:
    code = (
        "import sys, kcloak.cli.main, kcloak.broker.service, kcloak.broker.http_server, kcloak.broker.publication\n"
        "heavy = ('scipy', 'dask', 'distributed', 'nats', 'matplotlib', 'rich', 'hypothesis', 'pandas')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
