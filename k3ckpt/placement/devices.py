"""Device catalog and device sets: what the planner knows about the hardware.

A ``DeviceSpec`` is one accelerator model (catalog below, sources in
docs/devices.md).  A ``DeviceSet`` is a deployment: how many nodes of how many
GPUs, how GPUs group into scale-up domains (NVLink / Infinity Fabric islands),
host DRAM and NVMe drives per node, and the HBM each GPU reserves for the KV cache
and activations.

Units: bytes and bytes per second everywhere (Python ints for sizes).  Text
inputs use decimal units (``GB`` = 1e9, ``TB`` = 1e12) or binary ones (``GiB`` =
2**30); ``--nvme`` rates are decimal GB/s.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import NotFoundError, UsageError
from ..units import parse_size

__all__ = [
    "DeviceSpec",
    "NVMeDrive",
    "DeviceSet",
    "CATALOG",
    "lookup_device",
    "pcie_bandwidth",
    "parse_bytes",
    "parse_reserve",
    "parse_nvme",
    "DEFAULT_RESERVE_KV",
    "DEFAULT_RESERVE_ACT",
    "parse_devices",
    "preset_devices",
    "DEFAULT_HOST_DRAM_PER_GPU",
    "load_device_set",
    "device_set_from_dict",
]

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model.

    Attributes:
        name: catalog id (``H200-141G``).
        hbm_bytes: device memory, vendor nominal capacity in decimal GB (a little
            below what some tools show for HBM sold in GiB: conservative).
        hbm_bw: device memory bandwidth, bytes/s.
        scaleup_size: GPUs per scale-up domain (1 = none beyond PCIe).
        scaleup_bw: scale-up bandwidth per GPU as vendors quote it (both
            directions together), bytes/s; 0 without a scale-up fabric.
        pcie_gen: PCIe generation of the host link (x16).
        gpus_per_node: GPUs in one node (server, or compute tray for NVL72).
        host_link_bw: host to GPU bandwidth, one direction, bytes/s (PCIe x16
            nominal, or NVLink-C2C for Grace parts).
        source: where the figures come from (docs/devices.md has the links).
    """

    name: str
    hbm_bytes: int
    hbm_bw: float
    scaleup_size: int
    scaleup_bw: float
    pcie_gen: int
    gpus_per_node: int
    host_link_bw: float
    source: str

    def __post_init__(self):
        if not self.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise UsageError(f"device name {self.name!r} must be letters, digits, '.', '_' or '-'")
        for what in ("hbm_bytes", "scaleup_size", "pcie_gen", "gpus_per_node"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if what == "pcie_gen" else 1):
                raise UsageError(f"device {self.name}: {what} must be a positive integer, found {v!r}")
        for what in ("hbm_bw", "scaleup_bw", "host_link_bw"):
            v = getattr(self, what)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or v < 0:
                raise UsageError(f"device {self.name}: {what} must be a non-negative number, found {v!r}")
        if self.hbm_bw <= 0 or self.host_link_bw <= 0:
            raise UsageError(f"device {self.name}: hbm_bw and host_link_bw must be > 0")


def pcie_bandwidth(gen: int) -> float:
    """Nominal x16 bandwidth per direction, bytes/s (Gen3 16, Gen4 32, Gen5 64, Gen6 128 GB/s,
    rounded as vendors quote them; achieved pinned copies reach ~80 %)."""
    if gen < 1:
        raise UsageError(f"PCIe generation must be >= 1, found {gen}")
    return 16e9 * 2 ** (gen - 3)


def _spec(name, hbm_gb, hbm_tbs, domain, domain_gbs, gen, per_node, source, host_gbs=None):
    return DeviceSpec(
        name=name,
        hbm_bytes=int(round(hbm_gb * GB)),
        hbm_bw=hbm_tbs * TB,
        scaleup_size=domain,
        scaleup_bw=domain_gbs * GB,
        pcie_gen=gen,
        gpus_per_node=per_node,
        host_link_bw=host_gbs * GB if host_gbs else pcie_bandwidth(gen),
        source=source,
    )


# Figures: vendor datasheets (links in docs/devices.md).  GB200/GB300 nodes are
# compute trays of 4 GPUs (2 Grace CPUs) inside a 72-GPU NVLink domain; their host
# link is NVLink-C2C (900 GB/s both directions per Grace, taken as 450 one way).
CATALOG: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        _spec("H100-80G", 80, 3.35, 8, 900, 5, 8, "NVIDIA H100 SXM datasheet"),
        _spec("H200-141G", 141, 4.8, 8, 900, 5, 8, "NVIDIA H200 SXM datasheet"),
        _spec("B200-192G", 192, 8.0, 8, 1800, 5, 8, "NVIDIA HGX B200 / DGX B200 (180 GB usable in DGX)"),
        _spec("GB200-NVL72", 186, 8.0, 72, 1800, 5, 4, "NVIDIA GB200 NVL72 (13.4 TB HBM3e / 72 GPUs)", 450),
        _spec("GB300-NVL72", 288, 8.0, 72, 1800, 5, 4, "NVIDIA GB300 NVL72 (20.7 TB HBM3e / 72 GPUs)", 450),
        _spec("MI300X", 192, 5.3, 8, 896, 5, 8, "AMD Instinct MI300X datasheet (7 x 128 GB/s IF links)"),
        _spec("MI355X", 288, 8.0, 8, 1075, 5, 8, "AMD Instinct MI355X datasheet (7 x 153.6 GB/s IF links)"),
        _spec("RTX-4090", 24, 1.008, 1, 0, 4, 8, "NVIDIA GeForce RTX 4090 specifications"),
        _spec("RTX-5090", 32, 1.792, 1, 0, 5, 8, "NVIDIA GeForce RTX 5090 specifications"),
        _spec("RTX-PRO-6000", 96, 1.792, 1, 0, 5, 8, "NVIDIA RTX PRO 6000 Blackwell specifications"),
    )
}

_ALIASES = {"H100": "H100-80G", "H200": "H200-141G", "B200": "B200-192G", "GB200": "GB200-NVL72",
            "GB300": "GB300-NVL72", "4090": "RTX-4090", "5090": "RTX-5090", "PRO6000": "RTX-PRO-6000",
            "RTXPRO6000": "RTX-PRO-6000"}


def _norm(name: str) -> str:
    return re.sub(r"[-_ .]", "", name).upper()


def lookup_device(name: str) -> DeviceSpec:
    """Catalog entry by name; case, '-', '_' and spaces do not matter, and short
    names (``GB200``, ``H100``, ``5090``) work."""
    key = _norm(str(name))
    for cand in list(CATALOG) + list(_ALIASES):
        if _norm(cand) == key:
            return CATALOG[_ALIASES.get(cand, cand)]
    raise NotFoundError(f"unknown device {name!r}; known: {', '.join(CATALOG)}")


@dataclass(frozen=True)
class NVMeDrive:
    """One NVMe drive: sequential read bytes/s and capacity (None = not stated)."""

    read_bw: float
    capacity_bytes: int | None = None

    def __post_init__(self):
        if not np.isfinite(self.read_bw) or self.read_bw <= 0:
            raise UsageError(f"NVMe read bandwidth must be > 0, found {self.read_bw!r}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise UsageError(f"NVMe capacity must be > 0, found {self.capacity_bytes!r}")


@dataclass(frozen=True)
class DeviceSet:
    """A deployment of one device model.

    Attributes:
        device: the accelerator.
        nodes, gpus_per_node: the GPU count is their product; rank ``r`` lives on
            node ``r // gpus_per_node``.
        scaleup_domain: GPUs per scale-up domain, made of whole nodes or a part of
            one node (``1`` = every GPU alone); domains are consecutive ranks, the
            last may be smaller.
        host_dram_bytes: DRAM per node (0 = none usable).
        nvme: drives per node.
        reserved_kv_bytes, reserved_act_bytes: HBM per GPU kept for the KV cache and
            for activations / workspace.
    """

    device: DeviceSpec
    nodes: int
    gpus_per_node: int
    scaleup_domain: int
    host_dram_bytes: int = 0
    nvme: tuple[NVMeDrive, ...] = field(default_factory=tuple)
    reserved_kv_bytes: int = 0
    reserved_act_bytes: int = 0

    def __post_init__(self):
        for what in ("nodes", "gpus_per_node", "scaleup_domain"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"{what} must be a positive integer, found {v!r}")
        for what in ("host_dram_bytes", "reserved_kv_bytes", "reserved_act_bytes"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"{what} must be a non-negative integer, found {v!r}")
        d, n = self.scaleup_domain, self.gpus_per_node
        if d % n and n % d:
            raise UsageError(f"a scale-up domain of {d} GPUs must hold whole {n}-GPU nodes or divide a node")
        if self.reserved_bytes >= self.device.hbm_bytes:
            raise UsageError(
                f"reserved memory {self.reserved_bytes / GB:.1f} GB leaves nothing of "
                f"{self.device.name}'s {self.device.hbm_bytes / GB:.1f} GB"
            )
        object.__setattr__(self, "nvme", tuple(self.nvme))

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_kv_bytes + self.reserved_act_bytes

    @property
    def nvme_read_bw(self) -> float:
        """Sequential read bytes/s of one node's drives together."""
        return float(sum(d.read_bw for d in self.nvme))

    def gpu_node(self) -> np.ndarray:
        """``[G]`` node of every rank."""
        return np.arange(self.num_gpus) // self.gpus_per_node

    def gpu_domain(self) -> np.ndarray:
        """``[G]`` scale-up domain of every rank."""
        return np.arange(self.num_gpus) // self.scaleup_domain

    def to_dict(self) -> dict:
        out = asdict(self)
        out["nvme"] = [asdict(d) for d in self.nvme]
        return out

    def describe(self) -> str:
        nv = f", NVMe {len(self.nvme)} x {self.nvme[0].read_bw / GB:g} GB/s per node" if self.nvme else ""
        return (
            f"{self.num_gpus} x {self.device.name} ({self.nodes} node{'s' if self.nodes != 1 else ''} "
            f"x {self.gpus_per_node}, "
            f"scale-up {self.scaleup_domain}){nv}"
        )


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """``units.parse_size`` (kept under this name for callers of ``placement.devices``)."""
    return parse_size(text, what)


# HBM per GPU a plan keeps free for the KV cache and activations unless told otherwise
# (``k3ckpt plan`` and ``api.plan`` with a shorthand): 10 % in all.  K3's MLA cache
# is ~26.5 KB a token over its 23 MLA layers plus ~0.2 GB of KDA state a sequence, so
# 8 % of a 32 GB card (2.56 GB) holds a few 32k-token sequences; activations of a
# 512-token step fit in 2 %.  Filling HBM to the last byte with experts leaves the
# runtime nothing to run in.
DEFAULT_RESERVE_KV = "8%"
DEFAULT_RESERVE_ACT = "2%"


def parse_reserve(value: str | int | float, hbm_bytes: int, what: str = "reserve") -> int:
    """A reserve of HBM: a size (``4GB``) or a share of the GPU's HBM (``8%``)."""
    text = str(value).strip() if isinstance(value, str) else None
    if text and text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 <= pct < 100:
            raise UsageError(f"{what}: {text!r} must be a share of HBM from 0% to below 100%, or a size like 4GB")
        return int(hbm_bytes * pct / 100)
    return parse_size(value, what)


# Host DRAM per GPU a shorthand assumes when --host-dram is not given: the vendor's
# reference system divided by its GPUs (DGX H100 / H200 / B200: 2 TB for 8; a GB200 or
# GB300 tray: one 480 GB Grace per 2 GPUs; 8-GPU MI300X / MI355X platforms: 2 TB), and
# for workstation cards a common build (128 GB a card: 256 GB in a two-card RTX 5090
# box).  Plans say which figure they used; give --host-dram for the real one.
DEFAULT_HOST_DRAM_PER_GPU = {
    "H100-80G": 256 * GB, "H200-141G": 256 * GB, "B200-192G": 256 * GB, "GB200-NVL72": 240 * GB,
    "GB300-NVL72": 240 * GB, "MI300X": 256 * GB, "MI355X": 256 * GB, "RTX-4090": 64 * GB,
    "RTX-5090": 128 * GB, "RTX-PRO-6000": 192 * GB,
}


def preset_devices(spec: str, *, nvme: str | None = None, host_dram=None, reserved_kv=None, reserved_act=None,
                   **kw) -> tuple[DeviceSet, tuple[str, ...]]:
    """``parse_devices`` with the defaults a user of ``k3ckpt plan --devices`` expects:
    host DRAM from ``DEFAULT_HOST_DRAM_PER_GPU`` and a reserve of ``DEFAULT_RESERVE_KV`` +
    ``DEFAULT_RESERVE_ACT`` of HBM, each where not given.  Returns the set and notes
    naming the defaults used."""
    probe = parse_devices(spec, nvme=nvme, **kw)
    notes = []
    if host_dram is None:
        host_dram = DEFAULT_HOST_DRAM_PER_GPU.get(probe.device.name, 0) * probe.gpus_per_node
        notes.append(f"host DRAM: {host_dram / GB:,.0f} GB per node assumed for {probe.gpus_per_node} x "
                     f"{probe.device.name} (docs/devices.md); give --host-dram SIZE for yours")
    if reserved_kv is None and reserved_act is None:
        reserved_kv, reserved_act = DEFAULT_RESERVE_KV, DEFAULT_RESERVE_ACT
        notes.append(f"reserved HBM: {DEFAULT_RESERVE_KV} for the KV cache and {DEFAULT_RESERVE_ACT} for "
                     f"activations per GPU (default); --reserve-kv / --reserve-act change it")
    ds = parse_devices(spec, nvme=nvme, host_dram=host_dram, reserved_kv=reserved_kv or 0,
                       reserved_act=reserved_act or 0, **kw)
    return ds, tuple(notes)


def parse_nvme(text: str) -> tuple[NVMeDrive, ...]:
    """Drives per node: ``COUNTxGBPS[@CAPACITY]``, several groups joined by ``,``.

    ``2x14`` = two drives reading 14 GB/s each; ``4x7@3.84TB,1x14@8TB`` mixes kinds.
    """
    drives: list[NVMeDrive] = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*([0-9]+)\s*[xX]\s*([0-9]+(?:\.[0-9]*)?)\s*(?:@\s*(\S+))?\s*", part)
        if not m:
            raise UsageError(
                f"--nvme: cannot read {part.strip()!r}; write COUNTxGBPS[@CAPACITY], e.g. 2x14 or 2x14@4TB"
            )
        count, rate = int(m.group(1)), float(m.group(2))
        if count < 1 or rate <= 0:
            raise UsageError(f"--nvme: {part.strip()!r} needs at least one drive and a rate above 0 GB/s")
        cap = parse_bytes(m.group(3), "--nvme capacity") if m.group(3) else None
        drives += [NVMeDrive(read_bw=rate * GB, capacity_bytes=cap)] * count
    return tuple(drives)


def _default_domain(spec: DeviceSpec, nodes: int, per_node: int) -> int:
    """Scale-up domain for a shorthand: the catalog's, cut to the GPUs present and
    spread evenly over whole nodes (128 GB200 -> two 64-GPU domains)."""
    total = nodes * per_node
    if spec.scaleup_size <= per_node:
        return min(spec.scaleup_size, per_node) if per_node % min(spec.scaleup_size, per_node) == 0 else 1
    nodes_per_domain = max(1, spec.scaleup_size // per_node)
    n_dom = -(-nodes // nodes_per_domain)
    return min(total, -(-nodes // n_dom) * per_node)


def parse_devices(
    spec: str,
    *,
    nvme: str | None = None,
    host_dram: str | int | None = None,
    reserved_kv: str | int = 0,
    reserved_act: str | int = 0,
    gpus_per_node: int | None = None,
    scaleup_domain: int | None = None,
) -> DeviceSet:
    """Shorthand device set: ``NAME``, ``COUNTxNAME`` or ``NODESxPER_NODExNAME``.

    ``64xGB200`` = 16 trays of 4 in one 64-GPU NVLink domain; ``2xRTX-5090`` = one box
    with two cards; ``2x8xH100`` = two 8-GPU servers.  Counts above the catalog's
    node size must fill whole nodes.
    """
    text = str(spec).strip()
    m = re.fullmatch(r"(?:([0-9]+)\s*[xX]\s*)?(?:([0-9]+)\s*[xX]\s*)?([A-Za-z0-9][A-Za-z0-9 ._-]*)", text)
    if not m:
        raise UsageError(f"cannot read device set {spec!r}; write COUNTxNAME (64xGB200) or NODESxGPUSxNAME (2x8xH100)")
    try:
        dev = lookup_device(m.group(3))
    except NotFoundError as exc:
        raise UsageError(str(exc)) from None
    a, b = m.group(1), m.group(2)
    if a is not None and int(a) < 1 or b is not None and int(b) < 1:
        raise UsageError(f"device set {spec!r}: counts must be >= 1")
    if b is not None:
        nodes, per_node = int(a), int(b)
    else:
        count = int(a) if a is not None else 1
        per_node = gpus_per_node or dev.gpus_per_node
        if count <= per_node and gpus_per_node is None:
            nodes, per_node = 1, count
        elif count % per_node:
            raise UsageError(
                f"{count} GPUs do not fill whole {per_node}-GPU {dev.name} nodes; "
                f"write NODESxGPUSx{dev.name} or give gpus_per_node"
            )
        else:
            nodes = count // per_node
    if gpus_per_node is not None and b is not None and gpus_per_node != per_node:
        raise UsageError(f"device set {spec!r} says {per_node} GPUs per node, the option says {gpus_per_node}")
    domain = scaleup_domain or _default_domain(dev, nodes, per_node)
    return DeviceSet(
        device=dev,
        nodes=nodes,
        gpus_per_node=per_node,
        scaleup_domain=domain,
        host_dram_bytes=parse_bytes(host_dram, "host DRAM") if host_dram is not None else 0,
        nvme=parse_nvme(nvme) if nvme else (),
        reserved_kv_bytes=parse_reserve(reserved_kv, dev.hbm_bytes, "reserved KV cache"),
        reserved_act_bytes=parse_reserve(reserved_act, dev.hbm_bytes, "reserved activations"),
    )


_DEVICE_KEYS = {"name", "hbm", "hbm_bw", "scaleup_size", "scaleup_bw", "pcie_gen", "gpus_per_node", "host_link_bw",
                "source", "base"}
_SET_KEYS = {"device", "nodes", "gpus_per_node", "gpus", "scaleup_domain", "host_dram", "nvme", "reserved", "version"}


def _device_from(value) -> DeviceSpec:
    if isinstance(value, str):
        return lookup_device(value)
    if not isinstance(value, dict):
        raise UsageError(f"'device' must be a catalog name or a table, found {type(value).__name__}")
    extra = set(value) - _DEVICE_KEYS
    if extra:
        raise UsageError(f"unknown device keys {sorted(extra)}; allowed: {sorted(_DEVICE_KEYS)}")
    base = lookup_device(value["base"]) if "base" in value else None
    if base is None and "name" not in value:
        raise UsageError("a custom device needs 'name' (or 'base', a catalog name to start from)")
    fields = dict(asdict(base)) if base else {}
    if "name" in value:
        fields["name"] = str(value["name"])
    if "hbm" in value:
        fields["hbm_bytes"] = parse_bytes(value["hbm"], "device hbm")
    for key, unit in (("hbm_bw", 1), ("scaleup_bw", 1), ("host_link_bw", 1)):
        if key in value:
            fields[key] = float(parse_bytes(value[key], f"device {key}")) * unit
    for key in ("scaleup_size", "pcie_gen", "gpus_per_node"):
        if key in value:
            fields[key] = value[key]
    fields.setdefault("source", str(value.get("source", "device-set file")))
    if "pcie_gen" in fields and "host_link_bw" not in fields:
        fields["host_link_bw"] = pcie_bandwidth(int(fields["pcie_gen"]))
    missing = {"name", "hbm_bytes", "hbm_bw", "scaleup_size", "scaleup_bw", "pcie_gen", "gpus_per_node"} - set(fields)
    if missing:
        raise UsageError(f"custom device lacks {sorted(missing)}")
    return DeviceSpec(**fields)


def device_set_from_dict(data: dict, *, file: str | None = None) -> DeviceSet:
    """Device set from a parsed JSON/TOML table (schema in docs/devices.md)."""
    if not isinstance(data, dict):
        raise UsageError("a device-set file holds one table", file=file)
    extra = set(data) - _SET_KEYS
    if extra:
        raise UsageError(f"unknown keys {sorted(extra)}; allowed: {sorted(_SET_KEYS)}", file=file)
    if "device" not in data:
        raise UsageError("'device' is required", file=file)
    try:
        dev = _device_from(data["device"])
        per_node = data.get("gpus_per_node", dev.gpus_per_node)
        if "gpus" in data and "nodes" in data:
            raise UsageError("give 'nodes' or 'gpus', not both")
        if "gpus" in data:
            gpus = data["gpus"]
            if not isinstance(gpus, int) or gpus < 1:
                raise UsageError(f"'gpus' must be a positive integer, found {gpus!r}")
            if gpus < per_node and "gpus_per_node" not in data:
                per_node = gpus
            if gpus % per_node:
                raise UsageError(f"{gpus} GPUs do not fill whole {per_node}-GPU nodes")
            nodes = gpus // per_node
        else:
            nodes = data.get("nodes", 1)
        if not isinstance(nodes, int) or not isinstance(per_node, int):
            raise UsageError("'nodes' and 'gpus_per_node' must be integers")
        nvme = data.get("nvme", ())
        if isinstance(nvme, str):
            drives = parse_nvme(nvme)
        elif isinstance(nvme, (list, tuple)):
            drives = []
            for d in nvme:
                if not isinstance(d, dict) or set(d) - {"count", "read_gbps", "capacity"} or "read_gbps" not in d:
                    raise UsageError("each nvme entry is {count, read_gbps, capacity}")
                cap = parse_bytes(d["capacity"], "nvme capacity") if "capacity" in d else None
                drives += [NVMeDrive(float(d["read_gbps"]) * GB, cap)] * int(d.get("count", 1))
        else:
            raise UsageError("'nvme' must be a string like '2x14@4TB' or a list of tables")
        reserved = data.get("reserved", {})
        if not isinstance(reserved, dict) or set(reserved) - {"kv_cache", "activations"}:
            raise UsageError("'reserved' is a table with 'kv_cache' and/or 'activations'")
        domain = data.get("scaleup_domain") or _default_domain(dev, nodes, per_node)
        return DeviceSet(
            device=dev,
            nodes=nodes,
            gpus_per_node=per_node,
            scaleup_domain=domain,
            host_dram_bytes=parse_bytes(data.get("host_dram", 0), "host_dram"),
            nvme=tuple(drives),
            reserved_kv_bytes=parse_bytes(reserved.get("kv_cache", 0), "reserved kv_cache"),
            reserved_act_bytes=parse_bytes(reserved.get("activations", 0), "reserved activations"),
        )
    except UsageError as exc:
        if file and exc.file is None:
            raise UsageError(exc.detail, file=file) from None
        raise
    except NotFoundError as exc:
        raise UsageError(exc.detail, file=file) from None


def load_device_set(path: str | Path) -> DeviceSet:
    """Read a device-set file: ``.json``, or ``.toml`` where ``tomllib`` exists."""
    path = Path(path)
    if not path.is_file():
        raise NotFoundError("device-set file not found", file=str(path))
    raw = path.read_bytes()
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise UsageError("TOML device sets need Python >= 3.11 (tomllib); use JSON", file=str(path)) from None
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UsageError(f"not valid TOML: {exc}", file=str(path)) from None
    else:
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"not valid JSON: {exc}", file=str(path)) from None
    return device_set_from_dict(data, file=str(path))
