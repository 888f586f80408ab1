"""``k3ckpt requant`` from sources beyond MXFP4: block FP8, INT4, NVFP4, BF16 -> MXFP4 (both layouts) and 2.25 bpw.

The expected bytes are computed here from first principles: each source weight is
decoded whole with the format's numpy reference decoder (the pipeline decodes row
chunks with the numba kernels), and the bit-exact MXFP4 encoder is applied to
those values.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.errors import ResumeMismatchError, ShapeError, UnsupportedError, UsageError
from k3ckpt.fixtures.sources import SOURCE_FIXTURES, make_source_fixture, source_fixture
from k3ckpt.formats import get_format
from k3ckpt.formats.mxfp4 import decode_pair, encode_pair
from k3ckpt.io.reader import open_checkpoint
from k3ckpt.io.writer import save_file
from k3ckpt.requant import sources
from k3ckpt.requant.metrics import error_stats
from k3ckpt.requant.pipeline import requant_checkpoint

FIXTURES = sorted(SOURCE_FIXTURES)
EXPERTS = 4   # per MoE layer (the fixtures' default is 8): enough for fusing, half the time
_EXPERT = re.compile(r"^(?P<stem>.*\.experts)\.(?P<e>\d+)\.(?P<p>gate_proj|up_proj|down_proj)\.weight$")


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def run(src, dst, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    with open_checkpoint(src) as ckpt:
        return requant_checkpoint(ckpt, dst, **kw)


def folder_bytes(path: Path) -> dict[str, str]:
    return {p.name: sha(p.read_bytes()) for p in sorted(path.iterdir())
            if p.is_file() and p.name != "k3ckpt-manifest.json"}


def reference_values(ck, fmt_id: str, parts: dict[str, str]) -> np.ndarray:
    """A source weight decoded whole by its format's numpy reference."""
    return get_format(fmt_id).reference_decode({r: ck.read_raw(t) for r, t in parts.items()})


def routed_sources(ck) -> dict[str, np.ndarray]:
    """Logical routed-expert weight -> reference-decoded float32 values."""
    return {w.name: reference_values(ck, w.format, dict(w.parts)) for w in sources.find_weights(ck)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("rq-sources")
    return {name: make_source_fixture(name, root / name, experts=EXPERTS) for name in FIXTURES}


@pytest.fixture(scope="module")
def converted(built, tmp_path_factory):
    """Each fixture converted once per (format, layout) the tests read."""
    root = tmp_path_factory.mktemp("rq-out")
    cache = {}

    def get(name, fmt, layout=None):
        key = (name, fmt, layout)
        if key not in cache:
            dst = root / f"{name}-{fmt}-{layout}"
            cache[key] = (run(built[name], dst, format=fmt, layout=layout), dst)
        return cache[key]

    return get


def _group_parts_one_by_one(ckpt, profile, extra_rx=()):
    """group_parts as Profile.classify gives it name by name (the plain reference)."""
    from k3ckpt.profiles.roles import Role

    groups, meta = {}, {}
    for name, e in ckpt.tensors.items():
        tr = profile.classify(name, e.dtype)
        routed = tr.role == Role.ROUTED_EXPERT
        if tr.part == "bias" or not (routed or (extra_rx and tr.storage in sources.MXFP4_SOURCES)):
            continue
        groups.setdefault(tr.weight, {})[tr.part] = (name, e.dtype, tr.storage)
        meta.setdefault(tr.weight, (tr.layer, tr.expert, tr.projection, routed))
    return groups, meta


@pytest.mark.parametrize("extra_rx", [(), (r"self_attn",)])
def test_group_parts_in_one_pass_equals_classify_name_by_name(built, k3_tiny, extra_rx):
    from k3ckpt.profiles import detect

    for path in [*built.values(), k3_tiny]:
        with open_checkpoint(path) as ck:
            profile = detect(ck.config, ck.tensors.keys())
            got = sources.group_parts(ck, profile, extra_rx)
            want = _group_parts_one_by_one(ck, profile, extra_rx)
            assert got == want and list(got[0]) == list(want[0]) and got[0], path


@pytest.mark.parametrize("name", FIXTURES)
def test_source_weights_are_found_and_decoded_in_chunks(built, name, monkeypatch):
    with open_checkpoint(built[name]) as ck:
        found = sources.find_weights(ck)
        spec = source_fixture(name, experts=EXPERTS)
        assert len(found) == 3 * spec.experts * sum(1 for g in spec.groups() if ".experts.0.gate_proj" in g[0])
        assert {w.format for w in found} == {sources.find_weights(ck)[0].format} <= set(sources.FLOAT_SOURCES)
        ref = routed_sources(ck)
        # small chunks: 40-70 rows, the last one partial (128 for block FP8, whose scale rows cover 128)
        monkeypatch.setattr(sources, "_CHUNK_BYTES", 4 * 256 * 50)
        for w in found:
            got = sources.decode_slice(ck, w.slice(None), name=w.name)
            assert got.dtype == np.float32 and np.array_equal(got, ref[w.name], equal_nan=True), w.name


@pytest.mark.parametrize("name", FIXTURES)
def test_to_mxfp4_compressed_tensors_is_the_encoder_on_decoded_values(built, converted, name):
    result, dst = converted(name, "mxfp4")
    with open_checkpoint(built[name]) as src, open_checkpoint(dst) as out:
        ref = routed_sources(src)
        assert len(result.results) == len(ref) and result.bits_per_weight == 4.25
        for w, r in zip(result.plan.weights, result.results):
            x = ref[w.name]
            packed, scale = encode_pair(x)
            base = w.name[: -len(".weight")]
            assert np.array_equal(out.read_raw(base + ".weight_packed"), packed), w.name
            assert np.array_equal(out.read_raw(base + ".weight_scale"), scale), w.name
            assert r.stats == error_stats(x, decode_pair(packed, scale)) and r.format == "mxfp4-pack-quantized"
            assert 15.0 < r.stats.snr_db < 22.0 and abs(r.stats.bias_rel_rms) < 0.02 and r.bpw == 4.25
            assert r.params == x.size and w.in_bytes == sum(src.entry(t).nbytes for _, t in w.sources[0].parts)
        # every other tensor byte for byte, nothing of the source weights left
        for n in result.plan.copies:
            assert sha(out.read_bytes(n)) == sha(src.read_bytes(n)), n
        consumed = {t for w in result.plan.weights for s in w.sources for _, t in s.parts}
        assert set(src.tensors) == consumed | set(result.plan.copies)
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "mxfp4-pack-quantized"
    (group,) = qc["config_groups"].values()
    assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 32
    pats = [re.compile(t[3:]) for t in group["targets"]]
    with open_checkpoint(dst) as out:
        modules = {n[: -len(".weight_packed")] for n in out.tensors if n.endswith(".weight_packed")}
        every = {n.rsplit(".", 1)[0] for n in out.tensors}
    assert {m for m in every if any(p.fullmatch(m) for p in pats)} == modules
    assert qc["k3ckpt"]["layout"] == "compressed-tensors"
    assert json.loads((dst / "requant_report.json").read_text())   # the report is written


@pytest.mark.parametrize("name", FIXTURES)
def test_to_mxfp4_gpt_oss_layout_fuses_and_interleaves(built, converted, name, tmp_path):
    from k3ckpt import api

    result, dst = converted(name, "mxfp4", "gpt-oss")
    with open_checkpoint(built[name]) as src, open_checkpoint(dst) as out:
        ref = routed_sources(src)
        per: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        for wname, x in ref.items():
            m = _EXPERT.match(wname)
            per.setdefault((m["stem"], m["p"]), {})[int(m["e"])] = x
        stems = sorted({s for s, _ in per})
        assert len(result.results) == 2 * len(stems) * len(per[(stems[0], "down_proj")])
        for stem in stems:
            gate, up, down = (per[(stem, p)] for p in ("gate_proj", "up_proj", "down_proj"))
            blocks = {p: out.read_raw(f"{stem}.{p}_blocks") for p in ("gate_up_proj", "down_proj")}
            scales = {p: out.read_raw(f"{stem}.{p}_scales") for p in ("gate_up_proj", "down_proj")}
            n_e = len(gate)
            assert blocks["gate_up_proj"].shape[:2] == (n_e, 2 * gate[0].shape[0])
            for e in range(n_e):
                fused = np.empty((2 * gate[e].shape[0], gate[e].shape[1]), np.float32)
                fused[0::2], fused[1::2] = gate[e], up[e]   # gpt-oss: even rows gate, odd rows up
                for p, x in (("gate_up_proj", fused), ("down_proj", down[e])):
                    packed, scale = encode_pair(x)
                    assert np.array_equal(blocks[p][e].reshape(packed.shape), packed), (stem, p, e)
                    assert np.array_equal(scales[p][e], scale), (stem, p, e)
                    r = next(r for r in result.results if r.name == f"{stem}.{e}.{p}.weight")
                    assert r.stats == error_stats(x, decode_pair(packed, scale)) and r.expert == e
        for n in result.plan.copies:
            assert sha(out.read_bytes(n)) == sha(src.read_bytes(n)), n
        gu = next(w for w in result.plan.weights if w.projection == "gate_up")
        stem = gu.name[: -len("gate_up_proj.weight")]
        assert [s.parts[0][1].startswith(stem + p + ".") for s in gu.sources for p in ("gate_proj", "up_proj")] == [
            True, False, False, True]   # gate then up, both read
        assert set(gu.source_tensors) == {t for s in gu.sources for _, t in s.parts}
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4" and "lm_head" in qc["modules_to_not_convert"]
    assert not any("experts" in m and "shared" not in m for m in qc["modules_to_not_convert"])
    # k3ckpt dequant unfuses the layout on its own (even rows gate, odd rows up): same values
    d = api.dequant(dst, tmp_path / "deq", dtype="f32", tensors=r"\.experts\.(gate_up|down)_proj")
    with open_checkpoint(tmp_path / "deq") as deq:
        for wname, x in list(ref.items())[:: max(1, len(ref) // 7)]:
            packed, scale = encode_pair(x)
            assert np.array_equal(deq.read_raw(wname), decode_pair(packed, scale)), wname
    assert d.decoded


@pytest.mark.parametrize("name", FIXTURES)
def test_to_moet_w2_goes_through_mxfp4(built, converted, name):
    result, dst = converted(name, "moet-w2")
    fmt = get_format("moet-w2")
    with open_checkpoint(built[name]) as src, open_checkpoint(dst) as out:
        ref = routed_sources(src)
        for w, r in list(zip(result.plan.weights, result.results))[::5]:
            x = ref[w.name]
            packed, scale = encode_pair(x)
            want = fmt.from_mxfp4(packed, scale, method="refit")
            got = {role: out.read_raw(n) for role, n in w.outputs}
            assert all(np.array_equal(got[k], want[k]) for k in want), w.name
            # error against the source's decoded floats, not against the MXFP4 step
            assert r.stats == error_stats(x, fmt.decode(got)) and r.method == "refit"
            assert r.scale_changes == int(np.count_nonzero(got["scale"] != scale))
            assert 5.0 < r.stats.snr_db < 11.0 and sum(r.code_histogram) == r.params and r.bpw == 2.25
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "k3ckpt" and qc["source_quantization_config"] == json.loads(
        (built[name] / "config.json").read_text()).get("quantization_config")


def test_mx2_and_iq2_xs_from_fp8(tmp_path):
    src = make_source_fixture("deepseek-v3-tiny", tmp_path / "src", layers=2, experts=2, moe_intermediate=256)
    mx2 = run(src, tmp_path / "mx2", format="k3ckpt-mx2")
    iq = run(src, tmp_path / "iq", format="gguf-iq2_xs")
    with open_checkpoint(src) as ck, open_checkpoint(tmp_path / "mx2") as a, open_checkpoint(tmp_path / "iq") as b:
        ref = routed_sources(ck)
        for w, r in zip(mx2.plan.weights, mx2.results):
            want = get_format("k3ckpt-mx2").from_mxfp4(*encode_pair(ref[w.name]))
            assert all(np.array_equal(a.read_raw(n), want[role]) for role, n in w.outputs), w.name
            assert r.stats == error_stats(ref[w.name], get_format("k3ckpt-mx2").decode(want))
        for w, r in zip(iq.plan.weights, iq.results):
            want = get_format("gguf-iq2_xs").encode(ref[w.name])   # from the floats directly
            assert all(np.array_equal(b.read_raw(n), want[role]) for role, n in w.outputs), w.name
            assert r.stats.snr_db > 5.0 and r.bpw == 2.3125


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def _plain_moe(path: Path, *, k: int = 64, n: int = 32, experts: int = 2) -> Path:
    """One MoE layer with BF16 routed experts (generic names, no config)."""
    rng = np.random.default_rng(3)
    t = {"model.layers.0.input_layernorm.weight": np.ones(k, np.float32),
         "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((k, k)).astype(np.float32)}
    for e in range(experts):
        for p, shape in (("gate_proj", (n, k)), ("up_proj", (n, k)), ("down_proj", (k, n))):
            w = rng.standard_normal(shape).astype(np.float32) * 0.02
            t[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = _bf16(w)
    path.mkdir(parents=True)
    import ml_dtypes

    save_file(path / "model.safetensors", {
        name: (a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a) for name, a in t.items()})
    return path


def test_bf16_source_and_bad_shapes(tmp_path):
    src = _plain_moe(tmp_path / "ok")
    r = run(src, tmp_path / "ok-out", format="mxfp4")
    assert len(r.results) == 6 and {x.format for x in r.results} == {"mxfp4-pack-quantized"}
    assert all(w.source_format == "bf16" and w.in_bytes == 2 * w.params for w in r.plan.weights)
    with open_checkpoint(src) as ck, open_checkpoint(tmp_path / "ok-out") as out:
        for w in r.plan.weights:
            x = ck.read_raw(w.name).astype(np.uint32) << 16
            packed, scale = encode_pair(x.view(np.float32))
            assert np.array_equal(out.read_raw(w.outputs[0][1]), packed)
        assert out.read_bytes("model.layers.0.self_attn.q_proj.weight") == ck.read_bytes(
            "model.layers.0.self_attn.q_proj.weight")
    bad = _plain_moe(tmp_path / "bad", n=48)   # down_proj K = 48: not a multiple of 32
    with pytest.raises(ShapeError, match=r"experts\.0\.down_proj.*K = 48 is not a multiple"):
        run(bad, tmp_path / "bad-out", format="mxfp4")
    assert not (tmp_path / "bad-out").exists()
    fp8 = make_source_fixture("deepseek-v3-tiny", tmp_path / "fp8", layers=2, experts=2, moe_intermediate=200)
    with pytest.raises(ShapeError, match=r"experts\.0\.down_proj.*blocks of 32; K = 200 is not a multiple"):
        run(fp8, tmp_path / "fp8-out", format="moet-w2")


def _gpt_oss_bf16(path: Path, *, experts: int = 3, hidden: int = 64, inter: int = 32) -> Path:
    """transformers' GptOssExperts parameters: gate_up_proj [E, H, 2I], down_proj [E, I, H] (x @ W)."""
    import ml_dtypes

    rng = np.random.default_rng(4)
    x = "model.layers.0.mlp.experts"
    t = {f"{x}.gate_up_proj": rng.standard_normal((experts, hidden, 2 * inter)) * 0.02,
         f"{x}.gate_up_proj_bias": rng.standard_normal((experts, 2 * inter)),
         f"{x}.down_proj": rng.standard_normal((experts, inter, hidden)) * 0.02,
         f"{x}.down_proj_bias": rng.standard_normal((experts, hidden)),
         "model.layers.0.mlp.router.weight": rng.standard_normal((experts, hidden)),
         "lm_head.weight": rng.standard_normal((16, hidden))}
    path.mkdir(parents=True)
    save_file(path / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    (path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                                                  "num_local_experts": experts, "hidden_size": hidden,
                                                  "intermediate_size": inter, "num_hidden_layers": 1}))
    return path


def test_fused_bf16_gpt_oss_source_is_transposed(tmp_path):
    src = _gpt_oss_bf16(tmp_path / "src")
    a = run(src, tmp_path / "oss", format="mxfp4", layout="gpt-oss")
    b = run(src, tmp_path / "ct", format="mxfp4")
    x = "model.layers.0.mlp.experts"
    with open_checkpoint(src) as ck, open_checkpoint(tmp_path / "oss") as oss, open_checkpoint(tmp_path / "ct") as ct:
        for p in ("gate_up_proj", "down_proj"):
            w = ck.read_raw(f"{x}.{p}").astype(np.uint32) << 16
            w = w.view(np.float32)
            blocks, scales = oss.read_raw(f"{x}.{p}_blocks"), oss.read_raw(f"{x}.{p}_scales")
            for e in range(w.shape[0]):
                packed, scale = encode_pair(np.ascontiguousarray(w[e].T))   # [in, out] -> [out, in]
                assert np.array_equal(blocks[e].reshape(packed.shape), packed) and np.array_equal(scales[e], scale)
                assert np.array_equal(ct.read_raw(f"{x}.{e}.{p}.weight_packed"), packed)
            assert oss.read_bytes(f"{x}.{p}_bias") == ck.read_bytes(f"{x}.{p}_bias")
    assert len(a.results) == len(b.results) == 6
    qc = json.loads((tmp_path / "oss" / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["lm_head", "model.layers.*.mlp.router"]
    # a fused float tensor outside gpt-oss: its orientation is unknown, so it is refused
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    with pytest.raises(UnsupportedError, match="gpt-oss"):
        run(src, tmp_path / "never", format="mxfp4")


def test_resume_of_fused_layout_is_byte_identical(built, converted, tmp_path):
    name = "deepseek-v3-tiny"
    _, full = converted(name, "mxfp4", "gpt-oss")
    dst = tmp_path / "out"
    seen = []

    def boom(r):
        seen.append(r.name)
        if len(seen) == 11:
            raise RuntimeError("simulated crash")

    shard = 200_000
    with pytest.raises(RuntimeError, match="simulated"):
        run(built[name], dst, format="mxfp4", layout="gpt-oss", max_shard_bytes=shard, on_result=boom)
    with pytest.raises(ResumeMismatchError, match="layout"):
        run(built[name], dst, format="mxfp4", resume=True, max_shard_bytes=shard, layout="compressed-tensors")
    again = run(built[name], dst, format="mxfp4", layout="gpt-oss", max_shard_bytes=shard, resume=True)
    assert again.resumed_shards
    ref = tmp_path / "ref"
    run(built[name], ref, format="mxfp4", layout="gpt-oss", max_shard_bytes=shard)
    assert folder_bytes(dst) == folder_bytes(ref)
    with open_checkpoint(full) as a, open_checkpoint(dst) as b:   # shard size changes files, not tensors
        assert all(a.read_bytes(n) == b.read_bytes(n) for n in a.tensors)


@pytest.mark.slow   # spawns a process pool (about 10 s on 2 cores)
def test_pool_writes_the_same_fused_bytes(built, converted, tmp_path):
    _, one = converted("kimi-k2-thinking-tiny", "mxfp4", "gpt-oss")
    run(built["kimi-k2-thinking-tiny"], tmp_path / "two", format="mxfp4", layout="gpt-oss", workers=2)
    assert folder_bytes(one) == folder_bytes(tmp_path / "two")


def test_usage_errors(built, gpt_oss_tiny, tmp_path):
    src = built["deepseek-v3-tiny"]
    with pytest.raises(UsageError, match="MXFP4 only"):
        run(src, tmp_path / "a", format="moet-w2", layout="gpt-oss")
    with pytest.raises(UsageError, match="--layout must be"):
        run(src, tmp_path / "b", format="mxfp4", layout="gguf")
    with pytest.raises(UsageError, match="target-bpw"):
        run(src, tmp_path / "c", target_bpw=3.0)
    with pytest.raises(UsageError, match="select all"):
        run(src, tmp_path / "d", format="mxfp4", layout="gpt-oss", experts=r"experts\.0\.")
    # an MXFP4 source asked for MXFP4 is a copy; moving it to another layout is refused
    copy = run(gpt_oss_tiny, tmp_path / "copy", format="mxfp4")
    assert not copy.plan.weights and len(copy.plan.kept) == 4
    with open_checkpoint(gpt_oss_tiny) as a, open_checkpoint(tmp_path / "copy") as b:
        assert all(a.read_bytes(n) == b.read_bytes(n) for n in a.tensors) and set(a.tensors) == set(b.tensors)
    assert json.loads((tmp_path / "copy" / "config.json").read_text()) == json.loads(
        (Path(gpt_oss_tiny) / "config.json").read_text())
    with pytest.raises(UsageError, match="between layouts"):
        run(gpt_oss_tiny, tmp_path / "e", format="mxfp4", layout="compressed-tensors")
    # --experts down with the gpt-oss layout: down fused, gate/up stay as they were
    r = run(src, tmp_path / "f", format="mxfp4", layout="gpt-oss", experts="down")
    assert {x.projection for x in r.results} == {"down"} and all(k.endswith(("gate_proj.weight", "up_proj.weight"))
                                                                 for k in r.plan.kept)


def test_cli_layout(built, capsys, tmp_path):
    from k3ckpt.cli.main import main

    src = built["kimi-k2-thinking-tiny"]
    rc = main(["requant", str(src), str(tmp_path / "plan"), "--format", "mxfp4", "--layout", "gpt-oss", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "gpt-oss-mxfp4" in out and "source bytes" in out and not (tmp_path / "plan").exists()
    rc = main(["requant", str(src), str(tmp_path / "o"), "--format", "mxfp4", "--layout", "gpt-oss", "--workers", "1",
               "--json", "--quiet"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and {r["format"] for r in got["results"]} == {"gpt-oss-mxfp4"}
    assert {r["projection"] for r in got["results"]} == {"gate_up", "down"}
    with open_checkpoint(tmp_path / "o") as out:
        assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in out.tensors
    rc = main(["requant", str(src), str(tmp_path / "bad"), "--format", "moet-w2", "--layout", "gpt-oss"])
    assert rc != 0 and "MXFP4 only" in capsys.readouterr().err


def test_worker_float_path_with_carried_arrays(built):
    """A pool that cannot reopen the source (hub) gets the raw parts; same parts and result."""
    from k3ckpt.requant import worker
    from k3ckpt.requant.plan import plan_requant

    with open_checkpoint(built["nvfp4-tiny"]) as ck:
        plan = plan_requant(ck, format="k3ckpt-mx2")
        for w in plan.weights[:3]:
            arrays = worker.read_source(ck, w)
            assert isinstance(arrays, tuple) and set(arrays[0]) == {"packed", "scale", "global_scale"}
            i, parts, res = worker.compute(ck, w, arrays)
            j, parts2, res2 = worker.compute(ck, w)
            assert i == j == w.index and res == res2 and all(np.array_equal(parts[k], parts2[k]) for k in parts)
    x = np.zeros((4, 64), np.float32)
    x[0, :32] = np.linspace(-1, 1, 32)
    parts, r = worker.requant_floats(x, "moet-w2", "refit", name="w")
    # linspace over an even count has no exact 0: 32 of 256 values are nonzero
    assert r.source_zero_fraction == 1 - 32 / 256 and r.params == 256 and r.scale_changes is not None
    assert r.stats == error_stats(x, get_format("moet-w2").decode(parts))


def test_keep_scales_from_floats_is_the_runtime_map_of_their_mxfp4():
    from k3ckpt.requant.worker import requant_floats

    x = (np.random.default_rng(9).standard_normal((8, 128)) * 0.02).astype(np.float32)
    parts, r = requant_floats(x, "moet-w2", "keep-scales", name="w")
    want = get_format("moet-w2").from_mxfp4(*encode_pair(x), method="keep-scales")
    assert all(np.array_equal(parts[k], want[k]) for k in want) and r.scale_changes is None
    assert np.array_equal(parts["scale"], encode_pair(x)[1])   # keep-scales: MXFP4's exponents unchanged
