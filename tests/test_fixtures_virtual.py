"""The header-only full-size K3: real names, shapes, dtypes, order and totals."""

from __future__ import annotations

import gzip
import os
from collections import Counter
from importlib import resources

import pytest

from k3ckpt.fixtures import K3Dims, k3_layout, real_k3_index
from k3ckpt.io import build_header, read_header
from k3ckpt.io.dtypes import lookup

TOTAL = 1_560_860_324_864
EXPERT = 17_547_264
EXPERTS_TOTAL = 1_446_456_066_048
VISION = 894_717_952


def _nbytes(entry) -> int:
    return lookup(entry[1]).nbytes(entry[2])


@pytest.fixture(scope="module")
def layout():
    return k3_layout(K3Dims())


@pytest.fixture(scope="module")
def index():
    return real_k3_index()


def test_layout_is_the_released_index(layout, index):
    weight_map = {e[0]: shard for shard, entries in layout.items() for e in entries}
    assert len(weight_map) == 497_220 and len(layout) == 96
    assert weight_map == index["weight_map"]


def test_layout_totals(layout, index):
    sizes = {e[0]: _nbytes(e) for entries in layout.values() for e in entries}
    assert sum(sizes.values()) == TOTAL == index["metadata"]["total_size"]
    experts = {n: b for n, b in sizes.items() if ".experts." in n}
    assert sum(experts.values()) == EXPERTS_TOTAL == 82_432 * EXPERT
    per_expert = Counter()
    for n, b in experts.items():
        per_expert[n.split(".w")[0]] += b
    assert len(per_expert) == 92 * 896 and set(per_expert.values()) == {EXPERT}
    vision = [n for n in sizes if n.startswith(("vision_tower.", "mm_projector."))]
    assert len(vision) == 168 and sum(sizes[n] for n in vision) == VISION
    assert TOTAL - EXPERTS_TOTAL - VISION == 113_509_540_864  # "the rest of the text model"


def test_layer1_shard_matches_the_release(layout):
    """Shard 2's real header is 818,696 bytes and layer 1's expert 0 starts at data
    offset 1,267,744,256 (K3_FACTS, FORMATS 2.1): same tensors, order and encoding."""
    entries = layout["model-00002-of-000096.safetensors"]
    prefix, offsets = build_header([(n, dt, sh, _nbytes((n, dt, sh))) for n, dt, sh in entries])
    assert len(prefix) - 8 == 818_696
    names = [e[0] for e in entries]
    i = names.index("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
    assert offsets[i][0] == 1_267_744_256
    assert offsets[i + 5][1] - offsets[i][0] == EXPERT  # six contiguous tensors
    assert names[i + 6].endswith("experts.1.w1.weight_packed") and names[i + 12].endswith("experts.10.w1.weight_packed")


def test_virtual_k3_on_disk(virtual_k3, layout):
    shards = sorted(p for p in virtual_k3.iterdir() if p.suffix == ".safetensors")
    assert [p.name for p in shards] == list(layout)
    data = 0
    allocated = 0
    for p in shards:
        st = p.stat()
        allocated += st.st_blocks * 512
        if p.name in ("model-00002-of-000096.safetensors", "model-00094-of-000096.safetensors",
                      "model-00096-of-000096.safetensors"):
            h = read_header(p)
            assert h.file_size == st.st_size
            assert [(t.name, t.dtype, t.shape) for t in h.tensors.values()] == layout[p.name]
        data += st.st_size
    assert 0 < data - TOTAL < 96 * 1_000_000  # file sizes = headers (< 1 MB each) + all tensor data
    assert allocated < 200_000_000  # sparse: only headers take disk space
    raw = gzip.decompress(resources.files("k3ckpt.data").joinpath("k3_index.json.gz").read_bytes())
    assert (virtual_k3 / "model.safetensors.index.json").read_bytes() == raw
    assert (virtual_k3 / "config.json").is_file()
    assert not any(p.name.startswith(".") for p in virtual_k3.iterdir())


@pytest.mark.slow
def test_virtual_k3_opens_with_the_reader(virtual_k3):
    from k3ckpt.io import open_checkpoint
    from k3ckpt.profiles import Role, detect, expert_stats

    with open_checkpoint(virtual_k3) as ck:
        assert len(ck.tensors) == 497_220 and len(ck.shards) == 96 and ck.total_size == TOTAL
        prof = detect(ck.config, ck.tensors)
        st = expert_stats(ck.tensors, prof)
        assert (st.count, st.bytes_per_expert, st.total_bytes) == (82_432, EXPERT, EXPERTS_TOTAL)
        e = ck.entry("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
        assert e.data_offset == 8 + 818_696 + 1_267_744_256
        assert prof.classify(e.name, e.dtype).role is Role.ROUTED_EXPERT
        assert ck.read_bytes(e.name, 0, 16) == bytes(16)  # holes read as zeros
    assert os.path.getsize(virtual_k3 / "model-00002-of-000096.safetensors") == 8 + 818_696 + sum(
        ck.headers["model-00002-of-000096.safetensors"].tensors[n].nbytes
        for n in ck.headers["model-00002-of-000096.safetensors"].tensors)
