"""Window anonymization on a real Dask cluster in the test process (issue 15, proof 6)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kcloak.cloaking.cells import CellMap
from kcloak.streams.partitioned import PartParams, anonymize_partitioned, refusal_reason
from kcloak.streams.publish import anonymize
from kcloak.streams.quality import verify_k_delta
from tests.streams.test_partitioned_windows import same_table, window_fixes, with_loners

distributed = pytest.importorskip("distributed", reason="the cluster extra (dask[distributed]) is not installed")

from kcloak.broker.cluster.windows import anonymize_on_dask  # noqa: E402


@pytest.fixture(scope="module")
def dask_client() -> Iterator[Any]:
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


@pytest.mark.parametrize("method", ["nwa", "w4m", "microagg"])
def test_one_partition_on_dask_equals_the_single_process_output(dask_client: Any, method: str) -> None:
    fixes = window_fixes(11)
    single = anonymize(fixes, method=method, k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0, seed=5)
    params = PartParams(method=method, k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0)
    on_dask = anonymize_on_dask(dask_client, fixes, params, parts=1, seed=5)
    assert single.ok and on_dask.ok
    same_table(single.table, on_dask.table)


def test_many_partitions_on_dask_equal_the_same_partitions_here(dask_client: Any) -> None:
    fixes = window_fixes(12)
    cells = CellMap.balanced(fixes.lat, fixes.lon, cells=4)
    params = PartParams(method="w4m", k=3, delta_m=400.0, trash_max=0.3, pi_s=60.0)
    here = anonymize_partitioned(fixes, params, parts=4, cells=cells, seed=2)
    on_dask = anonymize_on_dask(dask_client, fixes, params, parts=4, cells=cells, seed=2)
    same_table(here.table, on_dask.table)
    assert on_dask.ok and verify_k_delta(on_dask.table, 3, 400.0).failures == ()


def test_dask_window_over_the_trash_bound_is_not_published(dask_client: Any) -> None:
    params = PartParams(method="nwa", k=3, delta_m=400.0, trash_max=0.1, pi_s=60.0)
    release = anonymize_on_dask(dask_client, with_loners(window_fixes(5), 5), params, parts=3, seed=1)
    assert not release.ok and len(release.table) == 0
    reason = refusal_reason(release)
    assert reason is not None and reason["reason"] == "trash_exceeded"


def test_without_the_cluster_extra_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kcloak.broker.cluster.windows import DaskMissing, require_dask

    monkeypatch.setitem(sys.modules, "distributed", None)  # what `import distributed` meets when it is absent
    with pytest.raises(
        DaskMissing, match=r"^windows published on Dask need the cluster extra: pip install 'kcloak\[cluster\]'$"
    ):
        require_dask()


def test_successive_windows_on_one_client_never_get_each_others_parts(dask_client: Any) -> None:
    """Task keys are never reused (a reused key makes Dask hand back the stored result of an earlier window)."""
    params = PartParams(method="nwa", k=3, delta_m=400.0, trash_max=0.2, pi_s=60.0)
    windows = [window_fixes(seed) for seed in (31, 32)]
    expected = [anonymize_partitioned(w, params, parts=2, seed=4) for w in windows]
    for i in range(6):
        got = anonymize_on_dask(dask_client, windows[i % 2], params, parts=2, seed=4)
        same_table(expected[i % 2].table, got.table)
