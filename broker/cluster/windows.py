"""Window anonymization on Dask (issue 15, docs/cluster.md "Window publication").

The window is cut by :func:`kcloak.streams.partitioned.plan_window` (NWA equivalence classes, or the start
cell of each trajectory); each part is one Dask task running the unchanged (k,δ) algorithm; the results are
gathered here and merged with the trash bound enforced over the whole window. Dask comes with the
``cluster`` extra; without it :func:`require_dask` raises :class:`DaskMissing` with the install command.
"""

from __future__ import annotations

import uuid
from types import ModuleType
from typing import Any

from kcloak.cloaking.cells import CellMap
from kcloak.core.extras import CLUSTER, MissingExtra, require
from kcloak.core.readers import FixTable
from kcloak.streams.partitioned import PartParams, anonymize_part, plan_window
from kcloak.streams.publish import Release

DaskMissing = MissingExtra
"""Dask distributed is not installed (the ``cluster`` extra is absent)."""


def require_dask() -> ModuleType:
    """The ``distributed`` module, or :class:`~kcloak.core.extras.MissingExtra` saying how to install it."""
    return require("distributed", extra=CLUSTER, purpose="windows published on Dask")


def anonymize_on_dask(
    client: Any,
    fixes: FixTable,
    params: PartParams,
    *,
    parts: int = 1,
    cells: CellMap | None = None,
    seed: int | None = None,
) -> Release:
    """A window's release with each part anonymized as a task of the Dask ``client`` (``distributed.Client``).

    Blocking: call it in a thread from async code.
    """
    require_dask()
    plan = plan_window(fixes, params, parts=parts, cells=cells)
    run = uuid.uuid4().hex  # a key never reused: Dask would hand back a stored result of the same key
    futures = [
        client.submit(anonymize_part, list(part), params, pure=False, key=f"kcloak-part-{run}-{i}")
        for i, part in enumerate(plan.parts)
    ]
    results = client.gather(futures)
    return plan.release(results, seed=seed)


__all__ = ["DaskMissing", "anonymize_on_dask", "require_dask"]
