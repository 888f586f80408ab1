"""The full-size virtual K3 (96 sparse shards, 1.56 TB) served by the loopback Hub:
remote open + inspect fetches < 0.1% of the repo and reports what local inspect reports."""

from __future__ import annotations

import time

import pytest
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.hub import open_hub_checkpoint
from k3ckpt.inspection import inspect_checkpoint
from k3ckpt.io import open_checkpoint


def _timed_inspect(opener, source):
    t = time.perf_counter()
    ck = opener()
    t_open = time.perf_counter() - t
    try:
        report = inspect_checkpoint(ck, source=source)
    finally:
        ck.close()
    return ck, report, t_open, time.perf_counter() - t


@pytest.mark.slow
def test_virtual_k3_remote_inspect(hub, virtual_k3, record_property):
    repo_bytes = sum(p.stat().st_size for p in virtual_k3.iterdir() if p.is_file())
    hub.add_repo("moonshotai/Kimi-K3", virtual_k3)
    url = "hf://moonshotai/Kimi-K3"
    remote, r_report, r_open, r_total = _timed_inspect(
        lambda: open_hub_checkpoint(url, endpoint=hub.endpoint, token=False), url)
    local, l_report, l_open, l_total = _timed_inspect(lambda: open_checkpoint(virtual_k3), url)

    fetched = remote.hub.bytes_fetched
    record_property("remote_open_s", round(r_open, 2))
    record_property("remote_open_inspect_s", round(r_total, 2))
    record_property("local_open_inspect_s", round(l_total, 2))
    record_property("bytes_fetched", fetched)
    record_property("bytes_served", hub.bytes_served)
    print(f"\nvirtual K3 over loopback: open {r_open:.1f}s, open+inspect {r_total:.1f}s "
          f"(local {l_open:.1f}s / {l_total:.1f}s); fetched {fetched:,} B of {repo_bytes:,} "
          f"({fetched / repo_bytes:.5%}); served incl. API JSON {hub.bytes_served:,} B")

    assert len(remote.shards) == 96 and len(remote.tensors) == 497_220
    assert fetched < repo_bytes / 1000 and hub.bytes_served < repo_bytes / 1000
    assert remote.hub.stats.range_requests <= 2 * 96
    assert r_report.to_json() == l_report.to_json()
    # The hub path's own cost on top of the shared header parsing and inspection
    # (the absolute time depends on the machine; see docs/hub.md for measurements).
    assert r_total - l_total < 10.0
