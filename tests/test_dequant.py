"""``dequant``: decoded values equal the format decoder, the rest byte-identical."""

from __future__ import annotations

import hashlib
import json

import ml_dtypes
import numpy as np
import pytest

from k3ckpt import api
from k3ckpt.errors import K3ckptError, OutputExistsError, UnsupportedError, UsageError
from k3ckpt.formats import get_format
from k3ckpt.io import open_checkpoint


def _sha(ckpt, name):
    h = hashlib.sha256()
    for chunk in ckpt.iter_chunks(name):
        h.update(chunk)
    return h.hexdigest()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_k3_tiny_decodes_every_expert_and_copies_the_rest(k3_tiny, tmp_path, dtype):
    out = tmp_path / "out"
    result = api.dequant(k3_tiny, out, dtype=dtype)
    fmt = get_format("mxfp4-pack-quantized")
    vdt = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[dtype]
    with open_checkpoint(k3_tiny) as src, open_checkpoint(out) as dst:
        packed = [n for n in src.tensors if n.endswith(".weight_packed")]
        assert len(result.decoded) == len(packed) > 0
        for name in packed:
            base = name[: -len("_packed")]
            want = fmt.reference_decode({"packed": src.read_raw(name), "scale": src.read_raw(base + "_scale")})
            got = dst.read_raw(base)
            assert dst.entry(base).dtype == {"bf16": "BF16", "f32": "F32"}[dtype]
            # MXFP4 values are exact in bf16 and f32
            np.testing.assert_array_equal(got.view(vdt).astype(np.float32), want)
        plain = [n for n in src.tensors if not n.endswith((".weight_packed", ".weight_scale"))]
        assert result.copied == len(plain)
        for name in plain:
            assert dst.entry(name).dtype == src.entry(name).dtype
            assert _sha(dst, name) == _sha(src, name)
        assert set(dst.tensors) == set(plain) | {n[: -len("_packed")] for n in packed}
        cfg = dst.config
    assert "quantization_config" not in cfg.get("text_config", {}) and "quantization_config" not in cfg
    assert (out / "tokenizer_config.json").exists()


def test_subset_narrows_quantization_config(k3_tiny, tmp_path):
    result = api.dequant(k3_tiny, tmp_path / "out", tensors=r"layers\.1\..*experts\.0\.w1")
    assert result.decoded == ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = cfg["text_config"]["quantization_config"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1" in qc["ignore"]
    with open_checkpoint(tmp_path / "out") as dst:
        assert "language_model.model.layers.1.block_sparse_moe.experts.1.w1.weight_packed" in dst.tensors


def test_gpt_oss_is_unfused_gate_even_up_odd(gpt_oss_tiny, tmp_path):
    out = tmp_path / "out"
    api.dequant(gpt_oss_tiny, out, dtype="f32")
    fmt = get_format("gpt-oss-mxfp4")
    with open_checkpoint(gpt_oss_tiny) as src, open_checkpoint(out) as dst:
        blocks = [n for n in src.tensors if n.endswith("gate_up_proj_blocks")]
        assert blocks
        for name in blocks:
            stem = name[: -len(".gate_up_proj_blocks")]
            fused = fmt.reference_decode({"blocks": src.read_raw(name),
                                          "scales": src.read_raw(stem + ".gate_up_proj_scales")})
            bias = src.read_raw(stem + ".gate_up_proj_bias")
            for e in range(fused.shape[0]):
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.gate_proj.weight"), fused[e, 0::2])
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.up_proj.weight"), fused[e, 1::2])
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.gate_proj.bias"), bias[e, 0::2])
                np.testing.assert_array_equal(dst.read_raw(f"{stem}.{e}.up_proj.bias"), bias[e, 1::2])
        assert not any(n.endswith(("_blocks", "_scales")) for n in dst.tensors)
        assert "quantization_config" not in dst.config


def test_nan_scales_decode_to_nan_and_are_counted(tmp_path):
    from k3ckpt.io import save_file

    packed = np.full((2, 32), 0x22, np.uint8)
    scale = np.full((2, 2), 0x7F, np.uint8)
    scale[1, 1] = 0xFF
    save_file(tmp_path / "src" / "model.safetensors" if False else tmp_path / "model.safetensors", {
        "model.layers.0.mlp.experts.0.w1.weight_packed": packed,
        "model.layers.0.mlp.experts.0.w1.weight_scale": scale,
    })
    result = api.dequant(tmp_path / "model.safetensors", tmp_path / "out", dtype="f32")
    assert result.nan_blocks == {"model.layers.0.mlp.experts.0.w1.weight": 1}
    with open_checkpoint(tmp_path / "out") as dst:
        x = dst.read_raw("model.layers.0.mlp.experts.0.w1.weight")
    assert np.isnan(x[1, 32:]).all() and not np.isnan(x[0]).any() and not np.isnan(x[1, :32]).any()


def test_refuses_non_empty_destination_and_bad_options(k3_tiny, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        api.dequant(k3_tiny, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    with pytest.raises(UsageError):
        api.dequant(k3_tiny, tmp_path / "x", dtype="int8")
    with pytest.raises(UsageError):
        api.dequant(k3_tiny, tmp_path / "y", tensors="(")
    with pytest.raises(UsageError):
        api.dequant(k3_tiny, tmp_path / "z", tensors="no-such-weight")
    with pytest.raises(K3ckptError):
        api.dequant(tmp_path / "missing", tmp_path / "w")


# -- sources beyond MXFP4: block FP8, INT4 pack-quantized, NVFP4 (both namings) -------------------

from k3ckpt import dequant as dequant_mod  # noqa: E402
from k3ckpt.errors import NaNScaleError  # noqa: E402
from k3ckpt.fixtures.sources import SOURCE_FIXTURES, make_source_fixture  # noqa: E402
from k3ckpt.io import save_file  # noqa: E402
from k3ckpt.io.dtypes import lookup  # noqa: E402

SOURCE_STORAGE = {"deepseek-v3-tiny": "fp8-block", "kimi-k2-thinking-tiny": "int4-pack-quantized",
                  "nvfp4-tiny": "nvfp4", "nvfp4-modelopt-tiny": "nvfp4-modelopt"}
_BITS = {"bf16": np.uint16, "f32": np.uint32}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("dequant-sources")
    assert set(SOURCE_STORAGE) == set(SOURCE_FIXTURES)  # a new source fixture gets a dequant test too
    return {name: make_source_fixture(name, root / name) for name in SOURCE_FIXTURES}


def _stored_parts(ck, fmt, base):
    return {role: ck.read_raw(t).view(np.dtype(lookup(ck.entry(t).dtype).storage))
            for role, t in fmt.tensor_names(base).items()}


def _registry_values(ck, fmt, base, dtype):
    """What the format registry decodes this weight to, as raw bits of the output dtype."""
    out = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[dtype]
    return fmt.decode(_stored_parts(ck, fmt, base), out=out).view(_BITS[dtype])


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("name", sorted(SOURCE_STORAGE))
def test_source_formats_decode_bit_exact_to_the_registry(sources, tmp_path, name, dtype):
    out = tmp_path / "out"
    result = api.dequant(sources[name], out, dtype=dtype)
    fmt = get_format(SOURCE_STORAGE[name])
    with open_checkpoint(sources[name]) as src, open_checkpoint(out) as dst:
        bases = sorted({fmt.match_name(n)[0] for n in src.tensors
                        if n.endswith(fmt.info.parts[1].suffix) and fmt.match_name(n)})
        assert bases and sorted(result.decoded) == sorted(b + ".weight" for b in bases)
        for base in bases:
            weight = base + ".weight"
            assert dst.entry(weight).dtype == {"bf16": "BF16", "f32": "F32"}[dtype]
            np.testing.assert_array_equal(dst.read_raw(weight).view(_BITS[dtype]),
                                          _registry_values(src, fmt, base, dtype), err_msg=weight)
        parts = {t for b in bases for t in fmt.tensor_names(b).values()}
        activation = {n for n in src.tensors if n.endswith(".input_scale")}
        assert set(result.dropped) == activation
        assert (len(activation) == len(bases)) == (name == "nvfp4-modelopt-tiny")
        plain = [n for n in src.tensors if n not in parts and n not in activation]
        assert result.copied == len(plain)
        for n in plain:
            assert dst.entry(n).dtype == src.entry(n).dtype and _sha(dst, n) == _sha(src, n)
        assert set(dst.tensors) == set(plain) | {b + ".weight" for b in bases}
        assert "quantization_config" not in dst.config
    assert result.skipped == () and result.nan_blocks == {}
    assert not (out / "hf_quant_config.json").exists()
    assert (out / "tokenizer_config.json").exists()


@pytest.mark.parametrize("name", ["kimi-k2-thinking-tiny", "nvfp4-tiny", "nvfp4-modelopt-tiny"])
def test_small_row_chunks_give_the_same_values(sources, tmp_path, monkeypatch, name):
    # about 40 rows per chunk: weights of 192 and 256 rows decode in several pieces, each with
    # the weight's own per-tensor parts (INT4 weight_shape, NVFP4 global scale / scale_2)
    monkeypatch.setattr(dequant_mod, "_CHUNK_BYTES", 4 * 256 * 40)
    fmt = get_format(SOURCE_STORAGE[name])
    with open_checkpoint(sources[name]) as ck:
        weights, _ = dequant_mod.find_quantized(ck)
        assert weights and all(len(list(dequant_mod._decode_chunks(ck, w))) > 1 for w in weights)
    api.dequant(sources[name], tmp_path / "out", dtype="f32")
    with open_checkpoint(sources[name]) as src, open_checkpoint(tmp_path / "out") as dst:
        for w in weights:
            base = w.weight[: -len(".weight")]
            np.testing.assert_array_equal(dst.read_raw(w.weight).view(np.uint32),
                                          _registry_values(src, fmt, base, "f32"), err_msg=w.weight)


def test_modelopt_subset_narrows_both_configs(sources, tmp_path):
    src = sources["nvfp4-modelopt-tiny"]
    assert (src / "hf_quant_config.json").exists()
    result = api.dequant(src, tmp_path / "out", tensors=r"layers\.1\.mlp\.experts\.0\.up_proj")
    module = "model.layers.1.mlp.experts.0.up_proj"
    assert result.decoded == (module + ".weight",) and result.dropped == (module + ".input_scale",)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert module in cfg["quantization_config"]["exclude_modules"]
    hqc = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    assert module in hqc["quantization"]["exclude_modules"] and hqc["quantization"]["quant_algo"] == "NVFP4"
    with open_checkpoint(tmp_path / "out") as dst:
        assert "model.layers.1.mlp.experts.1.up_proj.weight_scale_2" in dst.tensors
        assert module + ".weight_scale_2" not in dst.tensors and module + ".input_scale" not in dst.tensors


def test_fp8_subset_narrows_modules_to_not_convert(sources, tmp_path):
    api.dequant(sources["deepseek-v3-tiny"], tmp_path / "out", tensors=r"layers\.2\.mlp\.experts\.1\.down_proj")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["modules_to_not_convert"] == ["model.layers.2.mlp.experts.1.down_proj"]


def _fp8_file(path, shape, *, nan_tile=None):
    from k3ckpt.fixtures.generate import fp8_block_quantize

    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    q, s = fp8_block_quantize(x)
    if nan_tile is not None:
        s[nan_tile] = np.nan
    save_file(path, {"model.layers.0.mlp.experts.0.down_proj.weight": q,
                     "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv": s})
    return {"weight": q.view(np.uint8), "scale_inv": s}


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_fp8_row_chunks_start_on_tiles_at_partial_edges(tmp_path, monkeypatch, dtype):
    # 300 x 200: three tile rows (the last 44 rows), two tile columns (the last 72 wide)
    parts = _fp8_file(tmp_path / "model.safetensors", (300, 200))
    monkeypatch.setattr(dequant_mod, "_CHUNK_BYTES", 4 * 200 * 10)   # ten rows' worth -> one tile per chunk
    with open_checkpoint(tmp_path / "model.safetensors") as ck:
        (w,), _ = dequant_mod.find_quantized(ck)
        assert (w.format, w.shape) == ("fp8-block", (300, 200))
        chunks = [(r0, x.shape[0]) for r0, x, _ in dequant_mod._decode_chunks(ck, w)]
    assert chunks == [(0, 128), (128, 128), (256, 44)]
    api.dequant(tmp_path / "model.safetensors", tmp_path / "out", dtype=dtype)
    out = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[dtype]
    with open_checkpoint(tmp_path / "out") as dst:
        got = dst.read_raw("model.layers.0.mlp.experts.0.down_proj.weight").view(_BITS[dtype])
    want = get_format("fp8-block").reference_decode(parts, out=out).view(_BITS[dtype])
    np.testing.assert_array_equal(got, want)


def test_fp8_nan_tile_is_counted_and_decodes_to_nan(tmp_path, monkeypatch):
    _fp8_file(tmp_path / "model.safetensors", (300, 200), nan_tile=(2, 1))
    monkeypatch.setattr(dequant_mod, "_CHUNK_BYTES", 4 * 200 * 10)
    result = api.dequant(tmp_path / "model.safetensors", tmp_path / "out", dtype="f32")
    assert result.nan_blocks == {"model.layers.0.mlp.experts.0.down_proj.weight": 1}
    with open_checkpoint(tmp_path / "out") as dst:
        x = dst.read_raw("model.layers.0.mlp.experts.0.down_proj.weight")
    nan = np.isnan(x)
    assert nan[256:, 128:].all() and nan.sum() == 44 * 72


def test_int4_and_nvfp4_nan_scales_are_counted(tmp_path):
    from k3ckpt.formats.int4_pack import encode_int4
    from k3ckpt.formats.nvfp4 import encode_nvfp4

    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    packed, scale = encode_int4(x)
    scale[1, 0] = 0x7FC0      # bf16 quiet NaN
    scale[3, 1] = 0xFFC1      # negative NaN with payload
    save_file(tmp_path / "int4.safetensors", {
        "model.layers.0.mlp.experts.0.up_proj.weight_packed": packed,
        "model.layers.0.mlp.experts.0.up_proj.weight_scale": scale.view(ml_dtypes.bfloat16),
        "model.layers.0.mlp.experts.0.up_proj.weight_shape": np.array([4, 64], np.int64),
    })
    r = api.dequant(tmp_path / "int4.safetensors", tmp_path / "o1", dtype="f32")
    assert r.nan_blocks == {"model.layers.0.mlp.experts.0.up_proj.weight": 2}

    p, s, g = encode_nvfp4(x)
    s[0, 2] = 0x7F            # E4M3 NaN, both signs
    s[2, 3] = 0xFF
    save_file(tmp_path / "nvfp4.safetensors", {
        "model.layers.0.mlp.experts.0.up_proj.weight_packed": p,
        "model.layers.0.mlp.experts.0.up_proj.weight_scale": s.view(ml_dtypes.float8_e4m3fn),
        "model.layers.0.mlp.experts.0.up_proj.weight_global_scale": np.array([g], np.float32),
    })
    r = api.dequant(tmp_path / "nvfp4.safetensors", tmp_path / "o2", dtype="bf16")
    assert r.nan_blocks == {"model.layers.0.mlp.experts.0.up_proj.weight": 2}
    with open_checkpoint(tmp_path / "o2") as dst:
        y = dst.read_raw("model.layers.0.mlp.experts.0.up_proj.weight").view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.isnan(y[0, 32:48]).all() and np.isnan(y[2, 48:64]).all() and np.isnan(y).sum() == 32


def test_nan_per_tensor_scale_is_refused_before_writing(tmp_path):
    from k3ckpt.formats.nvfp4 import encode_nvfp4

    p, s, g = encode_nvfp4(np.ones((2, 32), np.float32), multiply=True)
    save_file(tmp_path / "m.safetensors", {
        "model.layers.0.mlp.experts.0.up_proj.weight": p,
        "model.layers.0.mlp.experts.0.up_proj.weight_scale": s.view(ml_dtypes.float8_e4m3fn),
        "model.layers.0.mlp.experts.0.up_proj.weight_scale_2": np.array(np.nan, np.float32),
    })
    with pytest.raises(NaNScaleError, match="weight_scale_2"):
        api.dequant(tmp_path / "m.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_modelopt_names_without_config_and_scalar_scale(tmp_path):
    from k3ckpt.formats.nvfp4 import encode_nvfp4

    x = np.random.default_rng(5).standard_normal((3, 48)).astype(np.float32)
    p, s, g = encode_nvfp4(x, multiply=True)
    base = "model.layers.0.mlp.experts.2.gate_proj"
    save_file(tmp_path / "m.safetensors", {
        f"{base}.weight": p, f"{base}.weight_scale": s.view(ml_dtypes.float8_e4m3fn),
        f"{base}.weight_scale_2": np.array(g, np.float32), f"{base}.input_scale": np.array(0.01, np.float32),
    })
    r = api.dequant(tmp_path / "m.safetensors", tmp_path / "out", dtype="f32")
    assert r.decoded == (f"{base}.weight",) and r.dropped == (f"{base}.input_scale",)
    with open_checkpoint(tmp_path / "out") as dst:
        assert set(dst.tensors) == {f"{base}.weight"}
        got = dst.read_raw(f"{base}.weight")
    want = get_format("nvfp4-modelopt").reference_decode({"packed": p, "scale": s, "scale_2": np.array(g, np.float32)})
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_parts_that_do_not_fit_are_left_with_a_reason(tmp_path):
    save_file(tmp_path / "m.safetensors", {
        "model.layers.0.mlp.experts.0.down_proj.weight": np.zeros((130, 64), ml_dtypes.float8_e4m3fn),
        "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv": np.ones((1, 1), np.float32),   # needs [2, 1]
    })
    with open_checkpoint(tmp_path / "m.safetensors") as ck:
        weights, bad = dequant_mod.find_quantized(ck)
    assert weights == [] and len(bad) == 2 and all("[2, 1]" in b for b in bad)
    with pytest.raises(UnsupportedError, match="scale_inv"):
        api.dequant(tmp_path / "m.safetensors", tmp_path / "out", tensors="down_proj")


def test_cli_reports_dropped_scales_and_nan_blocks(sources, tmp_path):
    from click.testing import CliRunner

    from k3ckpt.cli.dequant import command

    res = CliRunner().invoke(command, [str(sources["nvfp4-modelopt-tiny"]), str(tmp_path / "out"), "-q",
                                       "--dtype", "f32"])
    assert res.exit_code == 0, res.output
    assert "weight(s) decoded to f32" in res.output and "dropped 48 activation scale(s)" in res.output
    _fp8_file(tmp_path / "m.safetensors", (130, 64), nan_tile=(1, 0))
    res = CliRunner().invoke(command, [str(tmp_path / "m.safetensors"), str(tmp_path / "o2"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)   # the warnings are on stderr
    assert "1 block(s) in 1 weight(s) have a NaN scale" in res.stderr
    assert data["nan_blocks"] == {"model.layers.0.mlp.experts.0.down_proj.weight": 1} and data["dropped"] == []


# -- issue 17: planning at K3 scale, --dry-run, warnings, leftovers, shard size, manifest -------------


def test_planning_compares_no_weights_with_each_other(kimi_k2_tiny, tmp_path, monkeypatch):
    """Planning is O(N): no weight is looked up in a list of weights (`w not in todo` compared
    each weight with every earlier one: ~3e10 comparisons, ~3 h, for K3's 247,296)."""
    calls = []
    eq = dequant_mod.DecodedWeight.__eq__

    def counting(self, other):
        calls.append(1)
        return eq(self, other)

    monkeypatch.setattr(dequant_mod.DecodedWeight, "__eq__", counting)
    result = api.dequant(kimi_k2_tiny, tmp_path / "out", dtype="f32")
    assert len(result.decoded) == 72 and calls == []


def test_dry_run_writes_nothing_and_says_what_a_run_writes(k3_tiny, tmp_path):
    dry = api.dequant(k3_tiny, tmp_path / "a" / "out", dry_run=True, max_shard_size="4MB")
    assert not (tmp_path / "a").exists()
    assert dry.dry_run and dry.fits and dry.free_bytes > 0
    run = api.dequant(k3_tiny, tmp_path / "out", max_shard_size="4MB")
    assert (dry.tensors, dry.decoded, dry.copied, dry.bytes_written) == (196, run.decoded, 124, 14_717_472)
    assert len(dry.shards) == 5 and dry.shards == run.shards and dry.shards[-1] == "model.safetensors.index.json"
    with open_checkpoint(tmp_path / "out") as out:
        assert len(out.tensors) == run.tensors == 196


def test_dry_run_reports_too_little_space(k3_tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from click.testing import CliRunner

    from k3ckpt.cli.dequant import command

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    res = CliRunner().invoke(command, [str(k3_tiny), str(tmp_path / "out"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "would write" in res.output and "196 tensor(s)" in res.output and "1 shard(s)" in res.output
    assert "NOT enough free space: 1.00 KB free" in res.output and not (tmp_path / "out").exists()
    res = CliRunner().invoke(command, [str(k3_tiny), str(tmp_path / "out"), "--dry-run", "--json"])
    data = json.loads(res.stdout)
    assert data["dry_run"] is True and data["fits"] is False and data["tensors"] == 196


def test_cli_warnings_go_to_stderr_in_one_line(kimi_k2_tiny, tmp_path):
    from click.testing import CliRunner

    from k3ckpt.cli.dequant import command

    res = CliRunner().invoke(command, [str(kimi_k2_tiny), str(tmp_path / "out"), "-q"])
    assert res.exit_code == 0, res.output
    assert "warning:" not in res.stdout and res.stdout.startswith("wrote ")
    lines = res.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "in 72 weight(s) rounded by the bf16 output (most: model.layers." in lines[0]
    assert lines[0].endswith("--dtype f32 keeps them exact")
    res = CliRunner().invoke(command, [str(kimi_k2_tiny), str(tmp_path / "f32"), "-q", "--dtype", "f32"])
    assert res.exit_code == 0 and res.stderr == ""


def test_disk_space_error_leaves_no_folder_behind(k3_tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from k3ckpt.errors import DiskSpaceError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DiskSpaceError):
        api.dequant(k3_tiny, tmp_path / "new" / "out")
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    with pytest.raises(DiskSpaceError):
        api.dequant(k3_tiny, tmp_path / "mine")
    assert (tmp_path / "mine").is_dir() and list((tmp_path / "mine").iterdir()) == []


def test_failed_run_removes_what_it_created_only(k3_tiny, tmp_path, monkeypatch):
    from k3ckpt import dequant_run

    def boom(*a, **k):
        raise UnsupportedError("stop")

    monkeypatch.setattr(dequant_run, "_decode_chunks", boom)
    with pytest.raises(UnsupportedError):
        api.dequant(k3_tiny, tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    with pytest.raises(UnsupportedError):
        api.dequant(k3_tiny, tmp_path / "kept")
    assert (tmp_path / "kept").is_dir() and list((tmp_path / "kept").iterdir()) == []


def test_max_shard_size_cuts_shards_and_needs_a_unit(k3_tiny, tmp_path, capsys):
    from k3ckpt.cli.main import main

    assert main(["dequant", str(k3_tiny), str(tmp_path / "o"), "-q", "--max-shard-size", "2MB"]) == 0
    assert ", 8 shard(s), 14.72 MB" in capsys.readouterr().out   # the index is not a shard
    shards = sorted(p.name for p in (tmp_path / "o").glob("*.safetensors"))
    assert len(shards) == 8 and shards[0] == "model-00001-of-00008.safetensors"
    assert all(p.stat().st_size <= 2_000_000 + 50_000 for p in (tmp_path / "o").glob("*.safetensors"))
    assert (tmp_path / "o" / "model.safetensors.index.json").is_file()
    assert main(["dequant", str(k3_tiny), str(tmp_path / "p"), "--max-shard-size", "5"]) == 2
    assert not (tmp_path / "p").exists()
    assert api.dequant(k3_tiny, tmp_path / "q", dry_run=True).max_shard_bytes == 5_000_000_000


def test_output_has_a_manifest_that_verify_checks(k3_tiny, tmp_path):
    out = tmp_path / "out"
    api.dequant(k3_tiny, out, tensors=r"layers\.1\.")
    manifest = json.loads((out / "k3ckpt-manifest.json").read_text())
    assert manifest["job"] == "dequant" and manifest["state"] == "complete"
    assert manifest["options"] == {"dtype": "bf16", "tensors": r"layers\.1\.", "max_shard_bytes": 5_000_000_000}
    assert {"config.json", "model-00001-of-00001.safetensors", "tokenizer_config.json"} <= set(manifest["files"])
    r = api.verify(out, source=k3_tiny)
    assert r.ok and r.source_checked and r.tensors_checked == 244 and r.files_checked == len(manifest["files"])
    (out / "config.json").write_text("{}")
    assert any(p.startswith("config.json: ") for p in api.verify(out).problems)
