"""What the CLI asks besides the runs: the tables it lists, the Hub URL SRC spells, the report it
shows, and the figures its summaries print.  ``api`` re-exports each, so that the CLI imports
nothing of the package but ``api``, ``errors`` and ``render``; none of them reads or writes a
checkpoint.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UsageError


@dataclass(frozen=True)
class FormatEntry:
    """One row of ``k3ckpt formats``: the registry's ``FormatInfo`` and what it says about writing it."""

    info: Any
    from_mxfp4: bool       # writable as a transcode of MXFP4 codes
    requant_target: bool   # ``requant --format`` can write it

    def to_dict(self) -> dict:
        return {**self.info.to_dict(), "from_mxfp4": self.from_mxfp4, "requant_target": self.requant_target}


def formats() -> tuple[FormatEntry, ...]:
    """Every registered weight format, sorted by id."""
    from .formats import get_format, is_target, list_formats

    return tuple(FormatEntry(i, bool(i.mxfp4_codes), is_target(get_format(i.id))) for i in list_formats())


VIRTUAL_K3 = "k3-virtual"


def fixtures() -> dict[str, str]:
    """The fixtures ``make_fixture`` builds, name -> one-line description: the K3-shaped ones, the
    other sources, then ``k3-virtual``."""
    from .fixtures import FIXTURES
    from .fixtures.sources import SOURCE_FIXTURES

    out = {k: FIXTURES[k].description for k in sorted(FIXTURES)}
    out.update((k, SOURCE_FIXTURES[k].description) for k in sorted(SOURCE_FIXTURES))
    out[VIRTUAL_K3] = "full-size Kimi K3 headers (96 shards, 497,220 tensors), sparse data"
    return out


# ORG/NAME[@REVISION][/SUBFOLDER]: what hf:// takes after the scheme (hub/url.py checks the rest)
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[^/\s]+)?(/\S*)?")


def source_url(src: str | None, *, hub: bool = False, revision: str | None = None) -> str | None:
    """SRC as the commands take it: with ``hub``, a bare ``ORG/NAME[@REV][/SUB]`` is a Hub repo
    (``hf://`` added); ``revision`` (``--revision``) goes into an ``hf://`` URL, refused for a local
    path or when the URL names another."""
    from dataclasses import replace

    from .hub.url import SCHEME, is_hub_url, parse_hub_url

    if src is not None and hub and not is_hub_url(src):
        if not _REPO_ID.fullmatch(src):
            raise UsageError(f"--hub needs SRC as ORG/NAME[@REVISION][/SUBFOLDER], found {src!r}")
        src = SCHEME + src
    if src is None or revision is None:
        return src
    if not is_hub_url(src):
        raise UsageError(f"--revision {revision} picks a Hub revision; SRC {src!r} is a local path")
    url = parse_hub_url(src)
    if url.revision is not None and url.revision != revision:
        raise UsageError(f"SRC names revision {url.revision!r} and --revision {revision!r}: give one")
    return str(replace(url, revision=revision))


@dataclass(frozen=True)
class ReportView:
    """A requant error report as ``k3ckpt report`` shows it (``report`` is the ``RequantReport``)."""

    report: Any
    picture: Path | None   # requant_report.svg beside the JSON, when there is one

    def text(self) -> str:
        from .requant.report import render_text

        return render_text(self.report)

    def json_chunks(self):
        """The report's JSON in pieces (a large report is never one string)."""
        from .requant.report import json_chunks

        return json_chunks(self.report.to_json(lazy=True))


def report(path: str | os.PathLike, *, worst: int | None = None) -> ReportView:
    """Load the requant report at ``path`` (requant_report.json or its folder); ``worst``: list
    this many experts of lowest SNR (default: as stored)."""
    from .requant.report import load_report, resolve_report_path, with_worst

    rep = load_report(path)
    if worst is not None and worst != rep.worst_n:
        rep = with_worst(rep, worst)
    svg = resolve_report_path(path).with_name("requant_report.svg")
    return ReportView(rep, svg if svg.is_file() else None)


def snr_by_group(results) -> list[tuple[str, str, int, float]]:
    """``(format[:method], projection, params, pooled SNR dB)`` per group of requantized weights
    (``RequantResult.results``), sorted; the pooled SNR is ``requant.metrics.pooled_snr_db``."""
    from collections import defaultdict

    from .requant.metrics import pooled_snr_db

    by = defaultdict(list)
    for r in results:
        by[(r.format + (f":{r.method}" if r.method else ""), r.projection or "-")].append(r)
    return [(f, p, sum(r.params for r in rs), pooled_snr_db(r.stats for r in rs)) for (f, p), rs in sorted(by.items())]


def weighted_snr(results) -> tuple[float, int] | None:
    """``(pooled importance-weighted SNR dB, weights with an importance entry)`` of requant
    results (``--imatrix``), or None when none has one."""
    import math

    from .requant.metrics import snr_from_sums

    weighted = [r.weighted for r in results if r.weighted is not None]
    if not weighted:
        return None
    return snr_from_sums(math.fsum(w[0] for w in weighted), math.fsum(w[1] for w in weighted)), len(weighted)


def snr_reference(result, spec: str) -> str | None:
    """The reference figures of format ``spec`` beside a requant's overall SNR, as the report
    gives them (None for a format without them)."""
    from .requant.report_render import reference_for

    kept = sum(1 for r in result.results if r.method is None and r.format != spec.partition(":")[0])
    return reference_for(spec, result.snr_db, kept=kept)


def device_set(devices: str | None = None, device_file: str | os.PathLike | None = None, *, nvme=None,
               host_dram=None, reserve_kv=None, reserve_act=None):
    """``(DeviceSet, notes)`` for ``plan``: a device file as it is, or a shorthand (``"64xGB200"``)
    with the preset's host DRAM and the default HBM reserve where not given (notes say so)."""
    from .placement.devices import load_device_set, preset_devices

    if (devices is None) == (device_file is None):
        raise UsageError("give --devices SPEC (e.g. 64xGB200) or --device-file FILE, one of the two")
    if device_file is not None:
        if any(x is not None for x in (nvme, host_dram, reserve_kv, reserve_act)):
            raise UsageError("--nvme, --host-dram and --reserve-* go with --devices; put them in the device file")
        return load_device_set(device_file), ()
    return preset_devices(devices, nvme=nvme, host_dram=host_dram, reserved_kv=reserve_kv, reserved_act=reserve_act)


def plan_ceiling(best, dense_stream_s) -> tuple[float | None, str]:
    """A cache plan's tokens/s ceiling and what binds it (``placement.planner.binding_ceiling``)."""
    from .placement.planner import binding_ceiling

    return binding_ceiling(best, dense_stream_s)


def plan_stages(counts) -> tuple[str, bool]:
    """Decoder layers per pipeline rank as ``VLLM_PP_LAYER_PARTITION`` spells them, and whether
    that is vLLM's default split."""
    from .placement.stages import partition_text, pp_counts

    return partition_text(counts), list(counts) == pp_counts(sum(counts), len(counts))


def plan_fits_placement(p) -> bool:
    """Whether every expert of plan ``p``'s model would fit in HBM as a placement."""
    from .placement.spec import placement_slot_limit

    return placement_slot_limit(p.model, p.devices) * p.devices.num_gpus >= p.model.experts
