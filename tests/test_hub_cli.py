"""``k3ckpt inspect hf://...`` in a subprocess, pointed at the loopback Hub by HF_ENDPOINT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hubemu.fixtures import hub, hub_env  # noqa: F401  (pytest fixtures)

ROOT = str(Path(__file__).resolve().parents[1])


def run(hub, *args, **env):
    full = {**os.environ, "HF_ENDPOINT": hub.endpoint, "PYTHONPATH": ROOT, **env}
    return subprocess.run([sys.executable, "-m", "k3ckpt", *map(str, args)], capture_output=True, text=True,
                          env=full, timeout=300)


def test_inspect_hf_url_reports_like_local(hub, k3_tiny):
    repo = hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    remote = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny", "--json")
    assert remote.returncode == 0, remote.stderr
    local = run(hub, "inspect", k3_tiny, "--json")
    assert local.returncode == 0, local.stderr
    r, lo = json.loads(remote.stdout), json.loads(local.stdout)
    facts = r["extra"]["hub"]
    assert facts["commit"] == repo.commit() and facts["endpoint"] == hub.endpoint
    assert 0 < facts["bytes_fetched"] < sum(p.stat().st_size for p in Path(k3_tiny).iterdir()) / 4
    for k in ("source", "extra"):
        r.pop(k), lo.pop(k)
    assert r == lo
    text = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny")
    assert text.returncode == 0 and "fetched" in text.stdout


def test_inspect_hf_url_errors_are_one_line(hub, k3_tiny):
    hub.add_repo("moonshotai/Kimi-K3-tiny", k3_tiny)
    bad = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny@nope")
    assert bad.returncode == 2
    assert "no revision 'nope'" in bad.stderr and "[NotFoundError]" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    malformed = run(hub, "inspect", "hf://justone")
    assert malformed.returncode == 2 and "hf://ORG/NAME[@REVISION][/SUBFOLDER]" in malformed.stderr
    hub.reset_log()
    offline = run(hub, "inspect", "hf://moonshotai/Kimi-K3-tiny", HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and "[RemoteError]" in offline.stderr and "cache" in offline.stderr
    assert hub.log == []
