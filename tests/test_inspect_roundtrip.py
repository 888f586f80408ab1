"""``inspect`` of k3ckpt's own outputs: every format requant writes is recognised,
with the true parameter count and bits per weight (issue 17, item 1)."""

from __future__ import annotations

import math
import re

import pytest

from k3ckpt import api
from k3ckpt.formats import get_format, is_target, list_formats
from k3ckpt.io import open_checkpoint

TARGETS = [i.id for i in list_formats() if is_target(get_format(i.id))]
_EXPERT_CODES = re.compile(r"\.experts\.\d+\.w[123]\.weight_packed$")


@pytest.fixture(scope="module")
def source_facts(k3_tiny):
    """Logical shapes of k3-tiny's routed-expert weights, from its MXFP4 headers
    (two FP4 codes per byte), and the source's own report."""
    with open_checkpoint(k3_tiny) as ck:
        shapes = [(*e.shape[:-1], e.shape[-1] * 2) for n, e in ck.tensors.items() if _EXPERT_CODES.search(n)]
    return shapes, api.inspect(k3_tiny)


def _expected_bytes(fid: str, shapes) -> int:
    info = get_format(fid).info
    return sum(math.prod(s) * info.bytes_per_block // info.block + info.tensor_bytes for s in shapes)


def test_every_writer_is_covered():
    # the formats requant is documented to write are all in the round trip
    assert {"moet-w2", "k3ckpt-mx2", "gguf-iq2_xs", "mxfp4-pack-quantized", "nvfp4"} <= set(TARGETS)
    assert "fp8-block" not in TARGETS   # decode-only


@pytest.mark.parametrize("fid", TARGETS)
def test_inspect_reports_the_format_requant_wrote(k3_tiny, tmp_path, source_facts, fid):
    shapes, src = source_facts
    n_weights = len(shapes)
    params = sum(math.prod(s) for s in shapes)
    assert n_weights == 72 and params == 72 * 256 * 256
    api.requant(k3_tiny, tmp_path / "out", format=fid, workers=1, progress=False)
    r = api.inspect(tmp_path / "out")
    storage = {b.key: b for b in r.by_storage}
    assert fid in storage, sorted(storage)
    b = storage[fid]
    info = get_format(fid).info
    # plain dtypes share their bucket with the tensors that were already bf16/f16/f32
    before = {b.key: b for b in src.by_storage}.get(fid) if info.block == 1 else None
    assert b.params == params + (before.params if before else 0)
    assert b.bytes == _expected_bytes(fid, shapes) + (before.bytes if before else 0)
    if before is None:
        assert b.bits_per_weight == pytest.approx(info.bits_per_weight + 8 * info.tensor_bytes * n_weights / params)
    # nothing else changed: the same parameters, all routed experts seen, nothing unrecognised
    assert r.params_total == src.params_total and r.params_active == src.params_active
    assert r.routed_expert_params == params and r.routed_experts == 24
    assert r.unrecognised == () and r.warnings == ()


def test_inspect_of_a_mixed_output(k3_tiny, tmp_path, source_facts):
    shapes, src = source_facts
    api.requant(k3_tiny, tmp_path / "out", target_bpw=3.0, workers=1, progress=False)
    r = api.inspect(tmp_path / "out")
    storage = {b.key: b for b in r.by_storage}
    w2, mx = storage["moet-w2"], storage["mxfp4-pack-quantized"]
    per_weight = 256 * 256
    n_w2 = w2.params // per_weight
    assert n_w2 * per_weight == w2.params and 0 < n_w2 < 72
    assert w2.params + mx.params == sum(math.prod(s) for s in shapes)
    # each part in its own format's bytes: scales of both share one name template and shape
    assert w2.bits_per_weight == pytest.approx(2.25) and mx.bits_per_weight == pytest.approx(4.25)
    assert w2.tensors == 2 * n_w2 and mx.tensors == 2 * (72 - n_w2)   # packed + scale per weight
    assert r.params_total == src.params_total

def test_plan_of_a_moet_w2_output_counts_moet_w2_bytes(k3_tiny, tmp_path):
    from k3ckpt.placement import from_checkpoint as gfc

    api.requant(k3_tiny, tmp_path / "out", format="moet-w2", workers=1, progress=False)
    with api.open_source(tmp_path / "out") as ck:
        rep = gfc.moe_geometry_report(ck)
    # planned as stored: 3 weights of 256 x 256 at 9 B per 32 weights, labelled moet-w2
    assert rep.format_id == "moet-w2" and rep.source_storage == "moet-w2"
    assert rep.geometry.expert_bytes == 3 * 256 * 256 // 32 * 9 == 55_296
    assert rep.expert_weights == (("w1.weight", (256, 256)), ("w2.weight", (256, 256)), ("w3.weight", (256, 256)))


def test_a_config_that_misdescribes_the_header_is_reported(k3_tiny, tmp_path):
    import json
    import shutil

    api.requant(k3_tiny, tmp_path / "out", format="nvfp4", workers=1, progress=False)
    cfg_path = tmp_path / "out" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg["text_config"]["quantization_config"] if "text_config" in cfg else cfg["quantization_config"]
    qc["config_groups"]["group_0"]["format"] = "mxfp4-pack-quantized"   # but the scales are F8_E4M3
    cfg_path.write_text(json.dumps(cfg))
    r = api.inspect(tmp_path / "out")
    assert any("declares 72 tensor(s)" in w for w in r.warnings), r.warnings
    shutil.rmtree(tmp_path / "out")
