"""``k3ckpt verify`` on every writer's output: requant and dequant outputs with ``--source``,
the Moet runtime's own files beside a pack, and the one-line verdict (exit 1 failed, 2 bad input)."""

from __future__ import annotations

import json
import shutil

import pytest

from k3ckpt import api
from k3ckpt.cli.main import main
from k3ckpt.io import open_checkpoint
from k3ckpt.shard.verify import verify_output


@pytest.fixture(scope="module")
def requant_out(k3_tiny, tmp_path_factory):
    dst = tmp_path_factory.mktemp("verify") / "rq"
    api.requant(k3_tiny, dst, workers=1)
    return dst


def test_requant_output_against_its_source(k3_tiny, requant_out, tmp_path):
    r = verify_output(requant_out, source=k3_tiny)
    with open_checkpoint(requant_out) as out:
        n = len(out.tensors)
    assert r.ok and r.source_checked and r.tensors_checked == n == 268
    # a copied tensor changed (sha256 fixed up, so only the source comparison can see it)
    dst = tmp_path / "rq"
    shutil.copytree(requant_out, dst)
    name = "language_model.model.embed_tokens.weight"
    with open_checkpoint(dst) as out:
        shard = out.entry(name).shard
    raw = (dst / shard).read_bytes()
    n_header = int.from_bytes(raw[:8], "little")
    start = 8 + n_header + json.loads(raw[8: 8 + n_header])[name]["data_offsets"][0]
    with open(dst / shard, "r+b") as f:
        f.seek(start)
        b = f.read(1)
        f.seek(start)
        f.write(bytes([b[0] ^ 0xFF]))
    m = json.loads((dst / "k3ckpt-manifest.json").read_text())
    from k3ckpt.io.manifest import sha256_file

    m["files"][shard]["sha256"] = sha256_file(dst / shard)
    (dst / "k3ckpt-manifest.json").write_text(json.dumps(m))
    assert verify_output(dst).ok
    assert verify_output(dst, source=k3_tiny).problems == (f"{name}: bytes differ from the source",)


def test_requant_output_against_another_source(requant_out, kimi_k2_tiny):
    rep = verify_output(requant_out, source=kimi_k2_tiny)
    assert not rep.ok and rep.problems[0].startswith("the source is not the one this output was made from")


def test_dequant_output_with_a_tensor_missing(k3_tiny, tmp_path):
    out = tmp_path / "dq"
    api.dequant(k3_tiny, out)
    with open_checkpoint(k3_tiny) as ck:
        from k3ckpt.dequant import plan_dequant
        from k3ckpt.shard.verify_convert import plan_source_check

        with open_checkpoint(out) as o:
            plan = plan_source_check(o, ck, "dequant", {"dtype": "bf16", "tensors": None})
            assert (plan.expected, plan.transformed, len(plan.compare), plan.problems) == (196, 72, 124, ())
            # the same output checked as an f32 run's: the decoded weights are the wrong dtype
            f32 = plan_source_check(o, ck, "dequant", {"dtype": "f32", "tensors": None})
            assert len(f32.problems) == 72 and all("BF16" in p and "planned F32" in p for p in f32.problems)
        assert len(plan_dequant(ck).decoded) == 72


def test_moet_runtime_lock_and_heat_files_are_allowed(k3_tiny, tmp_path, capsys):
    plan = api.plan(k3_tiny, "2xRTX-5090", format="moet-w2", mode="cache")
    (tmp_path / "plan.json").write_text(plan.to_json())
    out = tmp_path / "m"
    assert main(["shard", str(k3_tiny), str(out), "--plan", str(tmp_path / "plan.json"), "-q",
                 "--layout", "moet"]) == 0
    packs = sorted(out.rglob("*.pack"))
    assert packs
    for p in packs:   # what the runtime leaves after one open
        (p.with_suffix(".lock")).write_bytes(b"")
        (p.parent / (p.name + ".heat.json")).write_text('{"version": 1, "keys": [[0, 1]]}')
    assert main(["verify", str(out)]) == 0
    (packs[0].parent / "other.lock").write_bytes(b"")   # not a pack's: still reported
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"k3ckpt: failed: {out}: 1 problem: moet-store/other.lock: not listed in the manifest"


def test_verdict_is_one_line_with_the_list_on_stderr(k3_tiny, tmp_path, capsys):
    out = tmp_path / "tamper"
    api.dequant(k3_tiny, out)
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    cap = capsys.readouterr()
    assert cap.out.startswith(f"FAILED: {out}: ")
    size = json.loads((out / "k3ckpt-manifest.json").read_text())["files"]["config.json"]["size"]
    first = f"config.json: 2 bytes, the manifest says {size:,}"
    assert cap.err.splitlines() == [f"  {first}", "  notes.txt: not listed in the manifest",
                                    f"k3ckpt: failed: {out}: 2 problems: {first} (and 1 more listed above)"]
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert main(["verify", str(k3_tiny)]) == 2   # a checkpoint, not a k3ckpt output
