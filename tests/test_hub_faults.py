"""hf:// reads when the Hub misbehaves: bounded retries on 5xx/429, resume after a
dropped connection, refusal of a server that ignores Range, clear errors when unreachable."""

from __future__ import annotations

import time

import pytest
from hubemu.ckpts import write_sharded
from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

from k3ckpt.errors import RemoteError
from k3ckpt.hub import HubClient, RetryPolicy, open_hub_checkpoint
from k3ckpt.io import open_checkpoint

FAST = RetryPolicy(max_retries=3, base_wait=0.01, max_wait=0.02)


@pytest.fixture
def toy(hub, tmp_path):
    d = tmp_path / "toy"
    tensors = write_sharded(d, 2)
    hub.add_repo("org/toy", d)
    return d, tensors


def _client(hub, retry=FAST) -> HubClient:
    return HubClient(hub.endpoint, token=False, retry=retry)


def _big(tensors) -> str:
    return next(n for n in tensors if n.endswith(".blocks"))


def test_500_on_model_info_then_success(hub, toy):
    hub.fail(500, times=2, match="api-model")
    client = _client(hub)
    with open_hub_checkpoint("hf://org/toy", client=client) as ck:
        assert ck.tensors
    assert [r.status for r in hub.settled_requests("api-model", 3)] == [500, 500, 200]
    assert client.stats.retries == 2


def test_500_on_range_reads_then_success(hub, toy):
    d, tensors = toy
    client = _client(hub)
    with open_hub_checkpoint("hf://org/toy", client=client) as ck:
        before = len(hub.requests("resolve"))
        hub.fail(503, times=2, match="resolve")
        name = _big(tensors)
        assert ck.read_bytes(name) == tensors[name].tobytes()
    got = hub.settled_requests("resolve", before + 3)[before:]     # in arrival order
    assert [r.status for r in got] == [503, 503, 206]


def test_429_with_retry_after_then_success(hub, toy):
    d, tensors = toy
    with open_hub_checkpoint("hf://org/toy", client=_client(hub)) as ck:
        before = len(hub.requests("resolve"))
        hub.fail(429, times=1, match="resolve", retry_after=0)
        name = _big(tensors)
        assert ck.read_bytes(name, 0, 4096) == tensors[name].tobytes()[:4096]
    got = hub.settled_requests("resolve", before + 2)[before:]     # in arrival order
    assert [r.status for r in got] == [429, 206]


def test_persistent_500_gives_up_bounded(hub, toy):
    d, tensors = toy
    with open_hub_checkpoint("hf://org/toy", client=_client(hub)) as ck:
        hub.reset_log()
        hub.fail(500, times=None, match="resolve")
        with pytest.raises(RemoteError, match="HTTP 500"):
            ck.read_bytes(_big(tensors))
    assert len(hub.settled_requests("resolve", FAST.max_retries + 1)) == FAST.max_retries + 1
    hub.clear_faults()
    hub.fail(502, times=None, match="api-model")
    with pytest.raises(RemoteError, match="HTTP 502"):
        open_hub_checkpoint("hf://org/toy", client=_client(hub))
    settled = hub.settled_requests("api-model", FAST.max_retries + 1)
    assert len([r for r in settled if r.status == 502]) == FAST.max_retries + 1


def test_dropped_connection_resumes_where_it_stopped(hub, toy):
    d, tensors = toy
    name = _big(tensors)
    client = _client(hub)
    with open_hub_checkpoint("hf://org/toy", client=client) as ck, open_checkpoint(d) as local:
        e = local.entry(name)
        hub.reset_log()
        hub.drop_after(10_000, times=2)
        assert ck.read_bytes(name) == tensors[name].tobytes()
    reqs = hub.settled_requests("resolve", 3)   # a dropped handler logs after the client moved on
    assert len(reqs) == 3 and client.stats.retries == 2
    starts = [int(r.range.removeprefix("bytes=").split("-")[0]) for r in reqs]
    assert starts == [e.data_offset, e.data_offset + 10_000, e.data_offset + 20_000]
    assert [r.sent for r in reqs] == [10_000, 10_000, e.nbytes - 20_000]
    # bytes fetched counts what moved, once each
    assert sum(r.sent for r in reqs) == e.nbytes


def test_dropping_forever_gives_up_bounded(hub, toy):
    d, tensors = toy
    with open_hub_checkpoint("hf://org/toy", client=_client(hub)) as ck:
        hub.reset_log()
        hub.drop_after(1000, times=None)
        with pytest.raises(RemoteError, match=r"failed after 4 tries"):
            ck.read_bytes(_big(tensors))
    assert len(hub.settled_requests("resolve", FAST.max_retries + 1)) == FAST.max_retries + 1


def test_server_ignoring_range_is_refused_not_downloaded(hub, toy):
    d, tensors = toy
    client = _client(hub)
    with open_hub_checkpoint("hf://org/toy", client=client) as ck:
        before = client.stats.bytes_fetched
        hub.ignore_range(times=1)
        with pytest.raises(RemoteError, match="does not serve ranges"):
            ck.read_bytes(_big(tensors), 0, 16)
        assert client.stats.bytes_fetched == before


def test_connection_closed_without_answer(hub, toy):
    hub.offline = True
    t = time.monotonic()
    with pytest.raises(RemoteError, match=r"hf://org/toy: cannot talk to http://127\.0\.0\.1"):
        open_hub_checkpoint("hf://org/toy", client=_client(hub))
    assert time.monotonic() - t < 30  # bounded, not a hang


def test_server_down(hub, toy):
    endpoint = hub.endpoint
    hub.stop()
    with pytest.raises(RemoteError, match="cannot talk to"):
        open_hub_checkpoint("hf://org/toy", client=HubClient(endpoint, token=False, retry=FAST))


def test_retry_policy_is_checked_and_bounded():
    with pytest.raises(Exception, match="max_retries"):
        RetryPolicy(max_retries=-1)
    p = RetryPolicy(max_retries=5, base_wait=1.0, max_wait=8.0)
    assert [p.wait(k) for k in range(1, 6)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert p.wait(1, retry_after=30) == 30 and p.wait(1, retry_after=10_000) == 120


def test_emulator_corrupt_fault_flips_served_bytes(hub, toy):
    # for the download step's hash checks: same ETag, different bytes
    d, tensors = toy
    name = _big(tensors)
    with open_hub_checkpoint("hf://org/toy", client=_client(hub)) as ck:
        hub.corrupt(times=1)
        bad = ck.read_bytes(name, 0, 8192)
        good = ck.read_bytes(name, 0, 8192)
    assert good == tensors[name].tobytes()[:8192] and bad != good
    assert sum(a != b for a, b in zip(bad, good)) == 2  # one flipped byte per 4 KiB
