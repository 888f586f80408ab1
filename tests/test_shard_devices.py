"""Device catalog, shorthands and device-set files."""

from __future__ import annotations

import json

import pytest

from k3ckpt.errors import NotFoundError, UsageError
from k3ckpt.placement.devices import (
    CATALOG,
    GB,
    load_device_set,
    lookup_device,
    parse_bytes,
    parse_devices,
    parse_nvme,
)

NAMES = ["H100-80G", "H200-141G", "B200-192G", "GB200-NVL72", "GB300-NVL72", "MI300X", "MI355X", "RTX-4090",
         "RTX-5090", "RTX-PRO-6000"]


def test_catalog_complete():
    assert sorted(CATALOG) == sorted(NAMES)
    for spec in CATALOG.values():
        assert spec.source and spec.hbm_bytes > 0 and spec.hbm_bw > 0 and spec.pcie_gen in (4, 5)
    assert CATALOG["H200-141G"].hbm_bytes == 141 * GB
    assert CATALOG["GB200-NVL72"].scaleup_size == 72
    assert CATALOG["RTX-5090"].scaleup_size == 1
    assert lookup_device("gb200") is CATALOG["GB200-NVL72"]
    assert lookup_device("rtx_pro_6000") is CATALOG["RTX-PRO-6000"]
    with pytest.raises(NotFoundError, match="known: H100-80G"):
        lookup_device("TPU")


def test_shorthands():
    ds = parse_devices("64xGB200")
    assert (ds.nodes, ds.gpus_per_node, ds.scaleup_domain, ds.num_gpus) == (16, 4, 64, 64)
    ds = parse_devices("128xGB200")
    assert ds.scaleup_domain == 64 and ds.gpu_domain().max() == 1  # two 64-GPU domains
    ds = parse_devices("72xGB200")
    assert ds.scaleup_domain == 72 and ds.gpu_domain().max() == 0
    ds = parse_devices("2xRTX-5090", nvme="2x14")
    assert (ds.nodes, ds.gpus_per_node, ds.scaleup_domain) == (1, 2, 1)
    assert len(ds.nvme) == 2 and ds.nvme_read_bw == 28 * GB and ds.nvme[0].capacity_bytes is None
    ds = parse_devices("2x8xH100", host_dram="2TB", reserved_kv="20GB", reserved_act="4GiB")
    assert (ds.nodes, ds.gpus_per_node, ds.scaleup_domain) == (2, 8, 8)
    assert ds.host_dram_bytes == 2 * 10**12 and ds.reserved_bytes == 20 * GB + 4 * 2**30
    assert ds.gpu_node().tolist() == [0] * 8 + [1] * 8


@pytest.mark.parametrize(
    "spec,match",
    [("0xH100", "counts"), ("12xH100", "whole 8-GPU"), ("64xFOO", "unknown device"), ("", "cannot read"),
     ("x", "unknown device"), ("4x", "unknown device"), ("2x8x", "unknown device")],
)
def test_bad_shorthands(spec, match):
    with pytest.raises(UsageError, match=match):
        parse_devices(spec)


def test_nvme_and_bytes():
    drives = parse_nvme("2x14@4TB,1x7")
    assert [d.read_bw for d in drives] == [14 * GB, 14 * GB, 7 * GB]
    assert drives[0].capacity_bytes == 4 * 10**12 and drives[2].capacity_bytes is None
    for bad in ("2x", "0x14", "2x0", "ax14", "2x14@", "2x14@4XB"):
        with pytest.raises(UsageError):
            parse_nvme(bad)
    assert parse_bytes("1.5TB") == 1_500_000_000_000 and parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes(123) == 123
    for bad in ("12 parsecs", "-5G", "", True):
        with pytest.raises(UsageError):
            parse_bytes(bad)


def test_sizes_need_a_unit():
    """A bare "512" would be 512 bytes: text without a unit is refused, with the fix."""
    from k3ckpt.units import parse_size

    for bare in ("512", " 512 ", "1.5"):
        with pytest.raises(UsageError, match=r"has no unit; give a unit, e\.g\. (512|1\.5)GB"):
            parse_size(bare, "--host-dram")
    assert parse_size("512GB") == 512 * GB and parse_size("4096B") == 4096 and parse_size("2PB") == 2 * 10**15
    assert parse_size(4096) == 4096   # API callers pass ints: bytes
    with pytest.raises(UsageError, match="no unit"):
        parse_devices("2xRTX-5090", host_dram="512")
    with pytest.raises(UsageError, match="no unit"):
        parse_nvme("2x14@4")
    with pytest.raises(UsageError, match="no unit"):
        from k3ckpt.placement.devices import device_set_from_dict

        device_set_from_dict({"device": "H100", "host_dram": "2048"})
    with pytest.raises(UsageError, match="leaves nothing"):
        parse_devices("RTX-4090", reserved_kv="30GB")


def test_device_set_files(tmp_path):
    data = {"device": "H200-141G", "nodes": 2, "host_dram": "2TB", "nvme": "4x14@3.84TB",
            "reserved": {"kv_cache": "30GB", "activations": "6GB"}}
    p = tmp_path / "set.json"
    p.write_text(json.dumps(data))
    ds = load_device_set(p)
    assert ds.num_gpus == 16 and ds.scaleup_domain == 8 and len(ds.nvme) == 4 and ds.reserved_bytes == 36 * GB
    t = tmp_path / "set.toml"
    t.write_text('gpus = 2\nhost_dram = "256GB"\n[device]\nbase = "RTX-5090"\nname = "RTX-5090-OC"\nhbm = "32GB"\n'
                 '[[nvme]]\ncount = 2\nread_gbps = 7\ncapacity = "2TB"\n')
    ds = load_device_set(t)
    assert ds.device.name == "RTX-5090-OC" and ds.num_gpus == 2 and ds.nvme_read_bw == 14 * GB
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "H100", "nodez": 2}))
    with pytest.raises(UsageError, match="unknown keys"):
        load_device_set(bad)
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_device_set(bad)
    bad.write_text(json.dumps({"device": "H100", "gpus": 12}))
    with pytest.raises(UsageError, match="whole"):
        load_device_set(bad)
    with pytest.raises(NotFoundError):
        load_device_set(tmp_path / "missing.json")
