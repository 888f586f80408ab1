"""``k3ckpt plan``: the command on small fixtures, its errors, and the worked examples
in docs/examples/ (K3 on 64xGB200 and on 2xRTX-5090 with NVMe) against the golden
files in tests/golden/.

The examples run on ``MoEGeometry.k3()``, which ``test_planning`` holds equal to the
geometry read from the header-only K3; the slow test runs the real command on it.
Regenerate after an intended change with ``K3CKPT_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from k3ckpt.cli.main import main
from k3ckpt.cli.plan import command, plan_from_options, render_plan
from k3ckpt.placement.spec import MoEGeometry, Plan

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
DOCS = ROOT / "docs" / "examples"
UPDATE = os.environ.get("K3CKPT_UPDATE_GOLDEN") == "1"
EXAMPLES = {
    # doc page -> (golden file, keep the whole plan?)
    "k3-64xGB200.md": ("plan_k3_64xGB200.json", False),
    "k3-2xRTX5090-nvme.md": ("plan_k3_2x5090.json", True),
}
SUMMARY = re.compile(r"<!-- summary:begin -->\n```text\n(.*?)\n```\n<!-- summary:end -->", re.S)
ERROR = re.compile(r"<!-- error:begin -->\n```text\n(.*?)\n```\n<!-- error:end -->", re.S)


# ----------------------------------------------------------------- helpers
def run_cli(args, capsys):
    rc = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def doc_command(page: str) -> list[str]:
    """The ``k3ckpt plan ...`` line of a docs example, as arguments after ``plan``."""
    text = (DOCS / page).read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("k3ckpt plan ")]
    assert len(lines) == 1, f"{page} must show exactly one k3ckpt plan command"
    return shlex.split(lines[0])[2:]


def example_plan(page: str) -> tuple[Plan, str]:
    """Run a docs example's command on ``MoEGeometry.k3()``: the plan and the output text."""
    args = doc_command(page)
    ctx = command.make_context("plan", list(args))
    params = dict(ctx.params)
    src = params.pop("src")
    assert src == "k3v", "examples plan the header-only K3 written by `k3ckpt fixture k3-virtual k3v`"
    p = plan_from_options(_k3(params), **params)
    text = render_plan(p) + (f"\n\nwrote {params['output']}" if params["output"] else "")
    return p, text


def _k3(params) -> MoEGeometry:
    """MoEGeometry.k3() as the checkpoint reads (model id from --model-id)."""
    import dataclasses

    return dataclasses.replace(MoEGeometry.k3(), model_id=params.get("model_id") or "")


def arrays_digest(p: Plan) -> str:
    """sha256 over the integer arrays of a plan (int64 little-endian, in a fixed order)."""
    h = hashlib.sha256()
    if p.mode == "placement":
        arrays = (p.placement.slot2gpu, p.placement.phy2log)
    else:
        arrays = (p.cache.layer_bounds, p.cache.hbm_slots, p.cache.host_slots, p.cache.preload)
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    return h.hexdigest()


def golden_of(p: Plan, whole: bool) -> dict:
    d = p.to_dict()
    if whole:
        return {"arrays_sha256": arrays_digest(p), "plan": d}
    pl = d.pop("placement")
    head = 2
    return {
        "why": "the full plan.json is about 10 MB (log2phy is [92][896][max replicas]); this file keeps the digest "
               "of its integer arrays, every other field, and the first layers",
        "arrays_sha256": arrays_digest(p),
        "plan": {**d, "placement": None},
        "placement_head": {"num_gpus": pl["num_gpus"], "slot2gpu": pl["slot2gpu"],
                           "phy2log": pl["phy2log"][:head], "logcnt": pl["logcnt"][:head]},
    }


def dump_golden(x, indent: int = 0) -> str:
    """JSON with objects indented and arrays on one line (readable diffs, small files)."""
    if not isinstance(x, dict) or not x:
        return json.dumps(x, separators=(", ", ": "))
    pad = " " * (indent + 1)
    items = [f"{pad}{json.dumps(k)}: {dump_golden(v, indent + 1)}" for k, v in x.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


def assert_same(got, want, where="$"):
    """Equal JSON values; floats to 1e-9 relative (ints, strings, shapes exactly)."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, (int, float)) and isinstance(want, (int, float)), where
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys differ"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ------------------------------------------------------- the worked examples
@pytest.fixture(scope="module")
def examples():
    return {page: example_plan(page) for page in EXAMPLES}


@pytest.mark.parametrize("page", sorted(EXAMPLES))
def test_worked_example_matches_golden(page, examples):
    p, text = examples[page]
    name, whole = EXAMPLES[page]
    got = json.loads(json.dumps(golden_of(p, whole)))
    if UPDATE:
        (GOLDEN / name).write_text(dump_golden(got) + "\n")
        doc = (DOCS / page).read_text()
        new = SUMMARY.sub(lambda m: f"<!-- summary:begin -->\n```text\n{text}\n```\n<!-- summary:end -->", doc)
        (DOCS / page).write_text(new)
    want = json.loads((GOLDEN / name).read_text())
    assert_same(got, want)
    if not whole:
        # the head really is the plan's first layers, and the plan validates
        assert want["placement_head"]["phy2log"] == p.placement.phy2log[:2].tolist()
    else:
        back = Plan.from_json(json.dumps(want["plan"]))
        assert arrays_digest(back) == want["arrays_sha256"]
    m = SUMMARY.search((DOCS / page).read_text())
    assert m, f"{page} lacks the summary block"
    assert m.group(1) == text


def test_worked_example_error_without_dense_host():
    """The 2 x RTX 5090 page shows the error the command gives without --dense host."""
    from k3ckpt.cli.main import error_message
    from k3ckpt.errors import UsageError

    page = "k3-2xRTX5090-nvme.md"
    args = doc_command(page)
    i = args.index("--dense")
    ctx = command.make_context("plan", args[:i] + args[i + 2:])
    params = dict(ctx.params)
    params.pop("src")
    with ctx, pytest.raises(UsageError) as exc:   # in the command's context: the CLI's wording
        plan_from_options(_k3(params), **params)
    line = error_message(exc.value)
    doc = (DOCS / page).read_text()
    if UPDATE:
        doc = ERROR.sub(lambda m: f"<!-- error:begin -->\n```text\n{line}\n```\n<!-- error:end -->", doc)
        (DOCS / page).write_text(doc)
    m = ERROR.search(doc)
    assert m and m.group(1) == line


def test_worked_examples_modes(examples):
    p64, _ = examples["k3-64xGB200.md"]
    assert p64.mode == "placement" and p64.devices.num_gpus == 64
    r = p64.placement_report
    assert r.colocated_replicas == 0 and r.max_gpu_memory_bytes <= p64.devices.device.hbm_bytes
    assert r.gap_to_lower_bound < 0.01 and r.balancedness > 0.99
    p2, _ = examples["k3-2xRTX5090-nvme.md"]
    assert p2.mode == "cache" and p2.devices.num_gpus == 2
    rep = p2.cache_report
    assert rep.simulated and [x.policy for x in rep.policies][-2:] == ["belady", "belady-bypass"]
    bel = rep.policy("belady-bypass").hbm_hit
    assert all(x.hbm_hit <= bel + 1e-12 for x in rep.policies)
    assert any("host DRAM" in n for n in p2.notes)


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(EXAMPLES))
def test_worked_example_on_virtual_k3(page, virtual_k3, tmp_path, capsys, examples):
    """The documented command on the header-only K3 gives the golden plan."""
    args = [str(virtual_k3) if a == "k3v" else a for a in doc_command(page)]
    out = tmp_path / "plan.json"
    args = [str(out) if a == "plan.json" else a for a in args]
    rc, text, err = run_cli(args, capsys)
    assert rc == 0, err
    p = Plan.from_json(out.read_text())
    name, whole = EXAMPLES[page]
    assert_same(json.loads(json.dumps(golden_of(p, whole))), json.loads((GOLDEN / name).read_text()))
    assert text.rstrip("\n").endswith(f"wrote {out}")
    assert text.replace(f"wrote {out}", "wrote plan.json").rstrip("\n") == examples[page][1]


# ----------------------------------------------------------- on small fixtures
def test_plan_placement_on_tiny_k3(k3_tiny, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc, text, err = run_cli([k3_tiny, "--devices", "8xH100", "-o", out], capsys)
    assert rc == 0, err
    p = Plan.from_json(out.read_text())
    assert p.mode == "placement" and p.model.moe_layers == 3 and p.model.experts == 8 and p.model.top_k == 2
    # 8 experts on 8 GPUs: default redundancy 8 // 8 = 1 slot
    assert p.placement_report.total_slots == 9
    for key in ("mode             placement", "balancedness", "gap to bound", "memory per GPU", "remote dispatch",
                "all-to-all", "note             loads: synthetic", f"wrote {out}"):
        assert key in text, key
    # --json: the summary without arrays; same plan again (deterministic)
    rc, js, err = run_cli([k3_tiny, "--devices", "8xH100", "--json", "--redundant", "0"], capsys)
    assert rc == 0, err
    d = json.loads(js)
    assert d["mode"] == "placement" and "placement" not in d and d["metrics"]["total_slots"] == 8
    assert d["output"] is None


def test_plan_cache_mode_with_device_file(k3_tiny, tmp_path, capsys):
    # a made-up 6 MB GPU: the dense weights (4.8 MB / 2) and a few experts fit, not all 24
    dev = tmp_path / "box.json"
    dev.write_text(json.dumps({"device": {"base": "RTX-5090", "name": "Tiny-GPU", "hbm": "3MB"}, "gpus": 2,
                               "host_dram": "1MB", "nvme": "1x7"}))
    loads = tmp_path / "loads.npy"
    np.save(loads, np.random.default_rng(0).lognormal(0, 1, (3, 8)))
    out = tmp_path / "p.json"
    rc, text, err = run_cli([k3_tiny, "--device-file", dev, "--loads", loads, "-o", out], capsys)
    assert rc == 0, err
    p = Plan.from_json(out.read_text())
    assert p.mode == "cache" and p.cache_report.policies[0].policy == "static"  # no trace: estimate only
    assert "mode             cache" in text and "tokens/s" in text and "NVMe experts" in text
    # with a trace: every policy, Belady included
    rng = np.random.default_rng(1)
    tr = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(64)])
    np.save(tmp_path / "tr.npy", tr.astype(np.int32))
    rc, text, err = run_cli([k3_tiny, "--device-file", dev, "--trace", tmp_path / "tr.npy"], capsys)
    assert rc == 0, err
    assert "belady" in text and "HBM hit rate" in text and "of Belady's" in text and "selection counts" in text


def test_plan_forced_cache_mode_says_so(k3_tiny, capsys):
    rc, text, err = run_cli([k3_tiny, "--devices", "2xH100", "--nvme", "1x7", "--mode", "cache"], capsys)
    assert rc == 0, err
    assert "mode             cache (forced by --mode cache; the experts would fit in HBM as a placement)" in text
    assert "the experts do not fit in HBM" not in text


def test_plan_reserves_hbm_by_default(k3_tiny, tmp_path, capsys):
    """10 % of HBM stays free for the KV cache and activations unless told otherwise."""
    out = tmp_path / "p.json"
    rc, text, err = run_cli([k3_tiny, "--devices", "8xH100", "-o", out], capsys)
    assert rc == 0, err
    d = Plan.from_json(out.read_text()).devices
    assert (d.reserved_kv_bytes, d.reserved_act_bytes) == (6_400_000_000, 1_600_000_000)   # 8 % + 2 % of 80 GB
    assert "reserved 8.00 GB" in text and "reserved HBM: 8% for the KV cache and 2% for activations" in text
    rc, text, err = run_cli([k3_tiny, "--devices", "8xH100", "--reserve-kv", "4GB", "--reserve-act", "5%", "-o",
                             out], capsys)
    assert rc == 0, err
    d = Plan.from_json(out.read_text()).devices
    assert (d.reserved_kv_bytes, d.reserved_act_bytes) == (4 * 10**9, 4 * 10**9)
    assert "reserved HBM:" not in text
    rc, _, err = run_cli([k3_tiny, "--devices", "8xH100", "--reserve-kv", "100%"], capsys)
    assert rc == 2 and "share of HBM" in err


def test_plan_host_dram_defaults_to_the_preset(k3_tiny, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc, text, err = run_cli([k3_tiny, "--devices", "2xRTX-5090", "--dense", "host", "-o", out], capsys)
    assert rc == 0, err
    p = Plan.from_json(out.read_text())
    assert 255 * 10**9 < p.devices.host_dram_bytes < 256 * 10**9   # 256 GB less the dense weights
    assert "host DRAM: 256 GB per node assumed for 2 x RTX-5090" in text
    rc, text, err = run_cli([k3_tiny, "--devices", "2xRTX-5090", "--host-dram", "64GB", "-o", out], capsys)
    assert Plan.from_json(out.read_text()).devices.host_dram_bytes == 64 * 10**9 and "assumed" not in text


def test_readme_few_gpu_example_runs_as_written():
    """README: `k3ckpt plan SRC --devices 2xRTX-5090 --nvme 2x14@4TB --dense host -o plan.json`
    (was: "0 B of host DRAM per node (give --host-dram)"); its headline is the binding
    ceiling, the dense stream at batch 1."""
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines()
                if ln.startswith("k3ckpt plan SRC --devices 2xRTX-5090"))
    args = shlex.split(line.split("#")[0])[2:]
    ctx = command.make_context("plan", list(args))
    params = dict(ctx.params)
    params.pop("src")
    p = plan_from_options(MoEGeometry.k3(), **params)
    r = p.cache_report
    assert p.mode == "cache" and p.devices.host_dram_bytes == 256 * 10**9 - 113_509_540_864
    assert r.binding == "dense-stream" and r.dense_stream_s == pytest.approx(113_509_540_864 / (64e9 * 0.8))
    assert r.tokens_per_s == pytest.approx(1 / r.dense_stream_s) and r.tokens_per_s < r.policy(r.best_policy).tokens_per_s
    text = render_plan(p)
    assert "tokens/s         ceiling 0.45 at batch 1, bound by streaming the dense weights" in text


MINI = {"device": {"base": "RTX-5090", "name": "Mini", "hbm": "2MB"}, "gpus": 2, "nvme": "1x7"}


@pytest.mark.parametrize("extra,match", [
    (["--devices", "8xH900"], r"unknown device 'H900'"),
    (["--devices", "8xH100", "--format", "mxfp3"], r"unknown --format 'mxfp3'.*mxfp4-pack-quantized"),
    (["--devices", "8xH100", "--device-file", "x.json"], r"--devices SPEC .* or --device-file"),
    (["--nvme", "2x14"], r"--devices SPEC .* or --device-file"),
    (["--devices", "8xH100", "--loads", "missing.npy"], r"loads file not found"),
    (["--device-file", "mini.json"], r"dense .* need .* per GPU .*--dense host"),
    (["--devices", "1xRTX-4090", "--dense", "host", "--host-dram", "0GB"], r"host DRAM"),
    (["--devices", "2xRTX-5090", "--host-dram", "512"], r"'512' has no unit; give a unit, e\.g\. 512GB"),
    (["--devices", "2xRTX-5090", "--reserve-kv", "4"], r"'4' has no unit"),
])
def test_plan_errors(k3_tiny, extra, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 2 MB GPUs: the tiny model's 4.8 MB of dense weights do not fit even split over two
    (tmp_path / "mini.json").write_text(json.dumps(MINI))
    rc, out, err = run_cli([k3_tiny, *extra], capsys)
    assert rc == 2 and out == ""
    assert re.search(match, err), err
    assert err.startswith("k3ckpt: error:") and err.count("\n") == 1


def test_plan_bad_loads(k3_tiny, tmp_path, capsys):
    bad = tmp_path / "wrong.npy"
    np.save(bad, np.ones((3, 16)))
    rc, _, err = run_cli([k3_tiny, "--devices", "8xH100", "--loads", bad], capsys)
    assert rc == 2 and "[3, 16]" in err and "[3, 8]" in err and "wrong.npy" in err
    for value, word in ((np.nan, "NaN"), (-1.0, "negative")):
        x = np.ones((3, 8))
        x[1, 5] = value
        f = tmp_path / f"l{word}.csv"
        f.write_text("\n".join(",".join(str(v) for v in row) for row in x))
        rc, _, err = run_cli([k3_tiny, "--devices", "8xH100", "--loads", f], capsys)
        assert rc == 2 and word in err and "expert 5" in err, err
    # a device set that cannot hold the model in any tier: 2 GPUs of 2 MB, no host DRAM, no NVMe
    dev = tmp_path / "d.json"
    dev.write_text(json.dumps({**MINI, "nvme": []}))
    rc, _, err = run_cli([k3_tiny, "--device-file", dev], capsys)
    assert rc == 2 and "cannot hold one copy" in err and "in any tier" in err


# ------------------------------------------------------------- plan's wording
def test_layer_ranges_read_as_words():
    from k3ckpt.cli.plan import _layer_ranges, _layers

    assert _layers([3]) == "layer 3" and _layers([1, 2, 3]) == "layers 1-3" and _layers([1, 3, 5]) == "layers 1, 3, 5"
    assert _layer_ranges((1, 2, 3), [0, 2, 3]) == "rank 0: layers 1-2; rank 1: layer 3"
    assert _layer_ranges((1, 2, 3), [0, 3, 3]) == "rank 0: layers 1-3; rank 1: none"


def test_human_durations():
    from k3ckpt.units import human_duration

    assert [human_duration(x) for x in (18267, 95, 4.2, 0.01, 200_000, None)] == [
        "5.1 h", "1.6 min", "4.2 s", "10 ms", "2.3 d", "-"]


def test_plan_warns_when_balance_means_nothing(k3_tiny, tmp_path, capsys):
    """8 experts a layer on 64 GB200s: 9 slots, 55 GPUs idle per layer; balancedness 0.07
    came without a word."""
    out = tmp_path / "p.json"
    rc, text, err = run_cli([k3_tiny, "--devices", "64xGB200", "-o", out], capsys)
    assert rc == 0, err
    p = Plan.from_json(out.read_text())
    assert p.placement_report.total_slots == 9 and p.placement_report.balancedness <= 9 / 64
    assert ("warning          8 experts per layer in 9 slots on 64 GPUs: 55 GPUs hold no expert of a layer, so "
            "balancedness cannot exceed 9/64 = 0.14") in text
    assert any(n.startswith("warning: 8 experts") for n in p.notes)
    rc, text, err = run_cli([k3_tiny, "--devices", "8xH100"], capsys)
    assert rc == 0 and "warning" not in text


def test_plan_names_the_model_from_its_profile(k3_tiny, capsys):
    """A local folder whose config names no model: the family inspect shows, not "(unnamed)"."""
    rc, text, err = run_cli([k3_tiny, "--devices", "8xH100"], capsys)
    assert rc == 0, err
    assert text.startswith("model            Kimi K3: 3 MoE layers x 8 experts, top-2")
    rc, text, err = run_cli([k3_tiny, "--devices", "8xH100", "--model-id", "me/k3-tiny"], capsys)
    assert text.startswith("model            me/k3-tiny: ")


@pytest.mark.parametrize("name", ["plan", "shard"])
def test_every_option_has_help_and_help_has_examples(name, capsys):
    """Every option of plan and shard says what it does; --help shows one or two examples."""
    from k3ckpt.cli.plan import command as plan_cmd
    from k3ckpt.cli.shard import command as shard_cmd

    cmd = {"plan": plan_cmd, "shard": shard_cmd}[name]
    missing = [o.opts[0] for o in cmd.params if o.param_type_name == "option" and not o.help]
    assert missing == []
    assert main([name, "--help"]) == 0
    text = capsys.readouterr().out
    examples = [ln.strip() for ln in text.split("Examples:")[1].split("Options:")[0].splitlines() if ln.strip()]
    assert 1 <= len(examples) <= 2 and all(ln.startswith(f"k3ckpt {name} ") for ln in examples)
