"""Requant error reports: pooled aggregates, JSON round trip, markdown, SVG, `k3ckpt report`."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import replace

import numpy as np
import pytest

from k3ckpt.cli.main import main
from k3ckpt.errors import InvalidFileError, NotFoundError, UsageError
from k3ckpt.requant.heatmap import colour, heatmap_grid, render_svg
from k3ckpt.requant.metrics import error_stats
from k3ckpt.requant.report import (
    JSON_NAME,
    MARKDOWN_NAME,
    SVG_NAME,
    ReportMeta,
    aggregate,
    build_report,
    dump_json,
    load_report,
    render_text,
    with_worst,
    write_report,
)
from k3ckpt.requant.report import _tensor_json
from k3ckpt.requant.results import TensorResult

SVG_NS = "{http://www.w3.org/2000/svg}"
PROJ = (("gate", "w1"), ("up", "w3"), ("down", "w2"))


def _result(name, layer, expert, proj, ref, approx, *, fmt="moet-w2", hist=(1, 2, 3, 4), changes=3):
    n = ref.size
    return TensorResult(
        name=name, layer=layer, expert=expert, projection=proj, format=fmt, method="refit",
        params=n, bytes=n // 4 + n // 32, stats=error_stats(ref, approx),
        max_row_bias=float(np.max(np.abs((approx - ref).mean(axis=1)))) / float(np.sqrt(np.mean(ref ** 2))),
        source_zero_fraction=float(np.mean(ref == 0)), code_histogram=tuple(hist), scale_changes=changes,
    )


def _make(layers=(1, 2, 4), experts=6, shape=(8, 64), seed=0, noise_of=None):
    """TensorResults from real arrays plus the arrays themselves: {name: (ref, approx)}."""
    rng = np.random.default_rng(seed)
    results, arrays = [], {}
    for layer in layers:
        for e in range(experts):
            for proj, w in PROJ:
                ref = rng.standard_normal(shape).astype(np.float32)
                ref[rng.random(shape) < 0.1] = 0.0
                sigma = noise_of(layer, e, proj) if noise_of else 0.2 + 0.05 * ((layer * 7 + e * 3) % 5)
                approx = (ref + rng.normal(0.01, sigma, shape)).astype(np.float32)
                name = f"model.layers.{layer}.mlp.experts.{e}.{w}.weight"
                results.append(_result(name, layer, e, proj, ref, approx))
                arrays[name] = (ref, approx)
    return results, arrays


def _concat_stats(arrays, names):
    ref = np.concatenate([arrays[n][0].ravel() for n in names])
    approx = np.concatenate([arrays[n][1].ravel() for n in names])
    return error_stats(ref, approx)


def _rel(a, b):
    return abs(a - b) / abs(b)


META = ReportMeta(source="fixture:k3-tiny", source_commit="abc123", options={"format": "moet-w2", "workers": 2})


# ---------------------------------------------------------------- aggregates

def test_pooled_snr_equals_error_stats_of_concatenation():
    results, arrays = _make()
    rep = build_report(results, META)
    want = _concat_stats(arrays, [r.name for r in results])
    o = rep.overall
    assert o.count == want.count and o.tensors == len(results)
    for attr in ("snr_db", "rel_mse", "rel_rms", "mean_bias", "bias_rel_rms", "ref_rms", "err_rms"):
        assert _rel(getattr(o, attr), getattr(want, attr)) < 1e-9, attr
    assert o.max_abs == want.max_abs
    # Not an average of dBs: with unequal errors the two differ clearly.
    mean_db = float(np.mean([r.stats.snr_db for r in results]))
    assert abs(mean_db - o.snr_db) > 0.01


_ORDER = {"gate": 0, "up": 1, "down": 2}


@pytest.mark.parametrize("section,keyfn,order", [
    ("by_layer", lambda r: (r.layer,), None),
    ("by_expert", lambda r: (r.layer, r.expert), None),
    ("by_projection", lambda r: (r.projection,), lambda k: _ORDER[k[0]]),
    ("by_format", lambda r: (r.format,), None),
])
def test_grouping(section, keyfn, order):
    results, arrays = _make()
    # Two formats, so by_format has two groups.
    results = [r if r.expert % 2 else replace(r, format="mx2") for r in results]
    rep = build_report(results, META)
    groups = {}
    for r in results:
        groups.setdefault(keyfn(r), []).append(r)
    got = getattr(rep, section)
    assert [a.key for a in got] == sorted(groups, key=order)
    for a in got:
        members = groups[a.key]
        want = _concat_stats(arrays, [r.name for r in members])
        assert a.tensors == len(members)
        assert a.params == sum(r.params for r in members) and a.bytes == sum(r.bytes for r in members)
        assert _rel(a.snr_db, want.snr_db) < 1e-9
        assert _rel(a.mean_bias, want.mean_bias) < 1e-9
        assert a.bpw == pytest.approx(8 * a.bytes / a.params)
        assert a.code_histogram == tuple(len(members) * c for c in (1, 2, 3, 4))
        assert a.scale_changes == 3 * len(members)
        zeros = sum(r.source_zero_fraction * r.params for r in members) / a.params
        assert a.zero_fraction == pytest.approx(zeros, rel=1e-12)
        assert a.max_row_bias == max(r.max_row_bias for r in members)


def test_projection_order_is_gate_up_down():
    results, _ = _make(layers=(1,), experts=2)
    rep = build_report(list(reversed(results)), META)
    assert [a.key[0] for a in rep.by_projection] == ["gate", "up", "down"]
    assert [a.key for a in rep.by_layer] == [(1,)]


def test_worst_experts_ordering():
    # Noise grows with a known (layer, expert) rank, so the worst list is predictable.
    def noise(layer, e, proj):
        return 0.1 + 0.02 * ((layer * 13 + e * 5) % 17)

    results, arrays = _make(layers=(0, 3, 5), experts=7, noise_of=noise)
    rep = build_report(results, META, worst_n=4)
    assert len(rep.worst_experts) == 4
    snrs = [a.snr_db for a in rep.by_expert]
    want = sorted(rep.by_expert, key=lambda a: (a.snr_db, a.key))[:4]
    assert rep.worst_experts == tuple(want)
    assert [a.snr_db for a in rep.worst_experts] == sorted(snrs)[:4]
    # Each worst row pools exactly that expert's three projections.
    w = rep.worst_experts[0]
    names = [r.name for r in results if (r.layer, r.expert) == w.key]
    assert len(names) == 3 and _rel(w.snr_db, _concat_stats(arrays, names).snr_db) < 1e-9
    assert len(with_worst(rep, 100).worst_experts) == len(rep.by_expert)
    assert with_worst(rep, 0).worst_experts == ()
    assert with_worst(rep, 6) == build_report(results, META, worst_n=6)


def test_degenerate_inputs():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    exact = _result("exact", 0, 0, "gate", x, x.copy())
    rep = build_report([exact], META)
    assert rep.overall.snr_db == math.inf and rep.overall.rel_rms == 0.0
    empty = build_report([], ReportMeta(source="nothing"))
    assert empty.overall.tensors == 0 and empty.overall.snr_db == math.inf and empty.by_expert == ()
    svg = render_svg(empty)
    ET.fromstring(svg)
    # Tensors without layer/expert (e.g. a dense weight) count overall but in no expert group.
    dense = _result("dense", None, None, None, x, x + 0.1)
    rep2 = build_report([exact, dense], META)
    assert rep2.overall.tensors == 2 and len(rep2.by_expert) == 1 and rep2.by_projection[0].tensors == 1
    # Mixed code-histogram lengths cannot be summed: reported as empty, not wrong.
    odd = _result("odd", 0, 1, "up", x, x + 0.1, hist=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16))
    assert aggregate([exact, odd]).code_histogram == ()
    assert aggregate([exact], key=("k",)).key == ("k",)


def test_bad_results_and_meta_are_refused():
    results, _ = _make(layers=(1,), experts=1)
    with pytest.raises(UsageError, match="more than once"):
        build_report(results + results[:1], META)
    with pytest.raises(UsageError, match="TensorResult"):
        build_report([{"name": "x"}], META)
    with pytest.raises(UsageError, match="worst_n"):
        build_report(results, META, worst_n=-1)
    with pytest.raises(UsageError, match="JSON"):
        ReportMeta(source="s", options={"bad": object()})
    with pytest.raises(UsageError, match="meta"):
        write_report(results, "unused")
    with pytest.raises(UsageError, match="source_commit"):
        ReportMeta(source="s", source_commit=123)
    with pytest.raises(UsageError, match="meta= only"):
        write_report(build_report(results, META), "unused", meta=META)
    with pytest.raises(UsageError, match="max_columns"):
        render_svg(build_report(results, META), max_columns=0)
    with pytest.raises(UsageError, match="worst_n"):
        with_worst(build_report(results, META), -2)


# ---------------------------------------------------------------- JSON

def test_json_round_trip(tmp_path):
    results, _ = _make()
    paths = write_report(results, tmp_path / "rep", meta=META, worst_n=5)
    assert paths.json == tmp_path / "rep" / JSON_NAME
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == sorted([JSON_NAME, MARKDOWN_NAME, SVG_NAME])
    original = build_report(results, META, worst_n=5)
    assert load_report(paths.json) == original
    assert load_report(tmp_path / "rep") == original          # the folder works too
    data = json.loads(paths.json.read_text())
    assert data["schema_version"] == 1 and data["kind"] == "k3ckpt-requant-report"
    assert data["meta"]["options"] == {"format": "moet-w2", "workers": 2}
    assert len(data["by_expert"]) == 18 and set(data["by_expert"][0]) >= {"layer", "expert", "snr_db", "bpw"}
    assert data["overall"]["snr_db"] == original.overall.snr_db
    # Same results -> same bytes (no clock in the report): a resumed run rewrites it identically.
    before = paths.json.read_bytes()
    write_report(results, tmp_path / "rep", meta=META, worst_n=5)
    assert paths.json.read_bytes() == before
    assert not [p for p in (tmp_path / "rep").iterdir() if p.name.startswith(".")]


def test_streamed_json_is_the_same_text():
    """write_report streams the JSON (json_chunks over lazy tensor rows): same text as dump_json,
    also with no tensor rows at all."""
    from k3ckpt.requant.report import json_chunks

    results, _ = _make()
    for rep in (build_report(results, META, worst_n=5), build_report(results[:0], META)):
        text = dump_json(rep.to_json())
        assert "".join(json_chunks(rep.to_json(lazy=True))) == text
        assert json.loads(text)["tensors"] == [json.loads(json.dumps(t)) for t in rep.to_json()["tensors"]]


def test_tensor_json_matches_tensor_result_to_dict():
    results, _ = _make(layers=(1,), experts=1)
    x = np.ones((2, 32), np.float32)
    results.append(_result("exact", 2, 0, "gate", x, x.copy(), changes=None))  # inf SNR
    for r in results:
        d = _tensor_json(r)
        assert d.pop("bpw") == r.bpw
        assert d == r.to_dict()
        assert TensorResult.from_dict(json.loads(json.dumps(d))) == r


def test_json_round_trip_with_infinities(tmp_path):
    x = np.arange(64, dtype=np.float32).reshape(2, 32)
    rep = build_report([_result("exact", 0, 0, "gate", x, x.copy())], ReportMeta(source="s"))
    text = dump_json(rep.to_json())
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["overall"]["snr_db"] == "inf"
    write_report(rep, tmp_path)
    assert load_report(tmp_path) == rep


def _write_and_edit(tmp_path, edit):
    results, _ = _make(layers=(1,), experts=2)
    p = write_report(results, tmp_path, meta=META).json
    data = json.loads(p.read_text())
    edit(data)
    p.write_text(json.dumps(data))
    return p


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(schema_version=2), "schema_version 2"),
    (lambda d: d.pop("schema_version"), "schema_version None"),
    (lambda d: d.update(kind="k3ckpt-plan"), "not a k3ckpt requant report"),
    (lambda d: d.pop("tensors"), "missing field 'tensors'"),
    (lambda d: d["tensors"][0].pop("stats"), "missing field 'stats'"),
    (lambda d: d["tensors"].pop(), "does not match its tensors"),
    (lambda d: d["overall"].update(snr_db=99.0), "'overall' does not match"),
    (lambda d: d["by_expert"][0].update(snr_db=1.0), "'by_expert' does not match"),
    (lambda d: d.update(worst_n="ten"), "worst_n"),
])
def test_load_rejects_wrong_schema(tmp_path, edit, match):
    p = _write_and_edit(tmp_path, edit)
    with pytest.raises(InvalidFileError, match=match) as e:
        load_report(p)
    assert str(p) in str(e.value)


def test_load_rejects_non_report_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(InvalidFileError, match="not a k3ckpt requant report"):
        load_report(bad)
    bad.write_text("{not json")
    with pytest.raises(InvalidFileError, match="not JSON"):
        load_report(bad)
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(InvalidFileError, match="UTF-8"):
        load_report(bad)
    with pytest.raises(NotFoundError):
        load_report(tmp_path / "missing.json")
    with pytest.raises(NotFoundError, match=JSON_NAME):
        load_report(tmp_path)   # a folder without a report


def test_extra_keys_of_a_later_version_1_writer_are_ignored(tmp_path):
    p = _write_and_edit(tmp_path, lambda d: d.update(future_section={"x": 1}))
    assert load_report(p).overall.tensors == 6


# ---------------------------------------------------------------- markdown, text, SVG

def test_markdown_has_summary_table_layers_worst_and_picture(tmp_path):
    results, _ = _make()
    paths = write_report(results, tmp_path, meta=META, worst_n=3)
    md = paths.markdown.read_text()
    rep = load_report(tmp_path)
    assert "## Summary" in md
    assert "| group | tensors | params | bytes | bits/weight | SNR dB |" in md
    all_row = next(line for line in md.splitlines() if line.startswith("| all |"))
    assert f"| {rep.overall.snr_db:.2f} |" in all_row and "| 2.2500 |" in all_row
    assert "## Worst experts (3 lowest SNR)" in md
    w = rep.worst_experts[0]
    assert f"| 1 | {w.key[0]} | {w.key[1]} | {w.snr_db:.2f} |" in md
    assert "## Per layer" in md
    for a in rep.by_layer:
        assert f"\n| {a.key[0]} | 6 | 18 |" in md
    assert f"]({SVG_NAME})" in md
    assert "`fixture:k3-tiny` (commit `abc123`)" in md


def test_render_text():
    results, _ = _make()
    rep = build_report(results, META, worst_n=2)
    text = render_text(rep)
    assert f"SNR {rep.overall.snr_db:.2f} dB" in text
    assert "worst 2 experts (of 18)" in text
    lines = text.splitlines()
    i = lines.index("worst 2 experts (of 18)")
    rows = [line.split() for line in lines[i + 3:i + 5]]
    assert [(int(r[0]), int(r[1]), int(r[2])) for r in rows] == [(k + 1, *a.key) for k, a in
                                                                  enumerate(rep.worst_experts)]
    assert len(lines) == i + 5


def _cells(svg: str):
    root = ET.fromstring(svg)
    return [el for el in root.iter(f"{SVG_NS}rect") if el.get("class") == "cell"], root


def test_svg_is_well_formed_with_one_cell_per_layer_and_expert():
    results, _ = _make(layers=(1, 2, 4), experts=6)
    rep = build_report(results, META)
    cells, root = _cells(render_svg(rep))
    assert root.tag == f"{SVG_NS}svg"
    assert len(cells) == 3 * 6
    assert len({(c.get("x"), c.get("y")) for c in cells}) == 18
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG_NS}text"))
    assert "layer" in texts and "expert" in texts and "SNR dB" in texts
    # Tooltips carry each expert's pooled SNR.
    titles = {c.find(f"{SVG_NS}title").text for c in cells}
    for a in rep.by_expert:
        assert f"layer {a.key[0]}, expert {a.key[1]}: {a.snr_db:.2f} dB" in titles
    # The histogram has bars for all 54 tensors (stacked by projection).
    bars = [el for el in root.iter(f"{SVG_NS}rect") if el.get("class") == "bar"]
    counts = sum(int(b.find(f"{SVG_NS}title").text.rsplit(": ", 1)[1]) for b in bars)
    assert counts == len(results)


def test_svg_bins_many_experts():
    # 3 layers x 300 experts with max 64 columns -> bins of 5 experts, 60 columns.
    from k3ckpt.requant.metrics import ErrorStats

    def fake(layer, e, proj):
        snr = 9.0 + 0.001 * e - 0.1 * layer
        er = 10 ** (-snr / 20)
        st = ErrorStats(count=100, nonfinite=0, snr_db=snr, rel_mse=er * er, rel_rms=er, mean_bias=0.0,
                        bias_rel_rms=0.0, max_abs=1.0, cosine=0.99, ref_rms=1.0, err_rms=er)
        return TensorResult(f"l{layer}.e{e}.{proj}", layer, e, proj, "moet-w2", "keep-scales", 100, 28, st,
                            0.0, 0.1, (), None)

    results = [fake(layer, e, p) for layer in (1, 2, 3) for e in range(300) for p, _ in PROJ]
    rep = build_report(results, ReportMeta(source="many"))
    layers, width, n_experts, grid = heatmap_grid(rep, 64)
    assert (layers, width, n_experts) == ([1, 2, 3], 5, 300)
    cells, _ = _cells(render_svg(rep, max_columns=64))
    assert len(cells) == 3 * 60 == len(grid)
    assert any(c.find(f"{SVG_NS}title").text.startswith("layer 2, experts 295-299:") for c in cells)
    # A bin pools its experts' energies.
    snr, first, last = grid[(1, 0)]
    pooled = aggregate([r for r in results if r.layer == 2 and r.expert < 5]).snr_db
    assert (first, last) == (0, 4) and snr == pytest.approx(pooled, rel=1e-12)
    # K3's geometry at the default cap stays readable: 896 experts -> 128 columns of 7.
    assert math.ceil(896 / math.ceil(896 / 128)) == 128


def test_colour_scale_ends():
    assert colour(0.0) == "#440154" and colour(1.0) == "#fde725"
    assert colour(-3) == colour(0.0) and colour(7) == colour(1.0)
    assert colour(0.5) == "#26828e"


# ---------------------------------------------------------------- CLI

@pytest.fixture
def report_dir(tmp_path):
    results, _ = _make()
    write_report(results, tmp_path / "out", meta=META)
    return tmp_path / "out"


def test_cli_prints_summary(report_dir, capsys):
    assert main(["report", str(report_dir), "--worst", "3"]) == 0
    out = capsys.readouterr().out
    rep = load_report(report_dir)
    assert f"SNR {rep.overall.snr_db:.2f} dB" in out
    assert "worst 3 experts (of 18)" in out
    assert SVG_NAME in out


def test_cli_json_is_parseable(report_dir, capsys):
    assert main(["report", str(report_dir / JSON_NAME), "--json", "--worst", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    rep = load_report(report_dir)
    assert data["schema_version"] == 1 and data["worst_n"] == 2 and len(data["worst_experts"]) == 2
    assert data["overall"] == json.loads(json.dumps(rep.to_json()["overall"]))


def test_cli_missing_path_is_one_line_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("k3ckpt: error:") and "no requant report at" in err


def test_cli_bad_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / JSON_NAME
    bad.write_text('{"kind": "k3ckpt-requant-report", "schema_version": 99}')
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "schema_version 99" in err and "Error]" not in err


# ------------------------------------------------------- reading the figures: references, scale, kept

@pytest.fixture(scope="module")
def tiny_reports(k3_tiny, tmp_path_factory):
    from k3ckpt import api

    root = tmp_path_factory.mktemp("reports")
    api.requant(k3_tiny, root / "w2", workers=1)
    api.requant(k3_tiny, root / "mixed", workers=1, target_bpw=3.0)
    return load_report(root / "w2"), load_report(root / "mixed")


def test_report_puts_the_formats_reference_points_beside_the_figure(tiny_reports):
    from k3ckpt.requant.report_render import render_markdown

    report = tiny_reports[0]
    text, md = render_text(report), render_markdown(report)
    line = next(x for x in text.splitlines() if x.startswith("reference"))
    # docs/BENCHMARKS.md: refit 8.106 dB on t5 (heavy-tailed) weights, 9.203 on Gaussian ones
    assert "8.11 dB on heavy-tailed" in line and "9.20 dB on Gaussian" in line
    assert f"{report.overall.snr_db:.2f} dB is within that range" in line
    assert "- reference: moet-w2 refit gives 8.11 dB" in md


def test_report_names_the_keep_scales_baseline_when_the_run_has_one():
    from k3ckpt.requant.report_render import reference_line

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    refit = _result("a", 0, 0, "gate", x, x + 0.30 * rng.standard_normal(x.shape).astype(np.float32))
    keep = replace(_result("b", 0, 1, "gate", x, x + 0.35 * rng.standard_normal(x.shape).astype(np.float32)),
                   method="keep-scales")
    report = build_report([refit, keep], ReportMeta(source="s", formats=("moet-w2", "moet-w2:keep-scales")))
    assert f"keep-scales baseline in this run: {keep.stats.snr_db:.2f} dB over its 1 tensor(s)" in \
        reference_line(report)


def test_heatmap_scale_spans_at_least_3_db_around_the_median(tiny_reports):
    from k3ckpt.requant.heatmap import _colour_range

    report = tiny_reports[0]
    _, _, _, cells = heatmap_grid(report)
    snrs = sorted(v[0] for v in cells.values())
    assert snrs[-1] - snrs[0] < 0.5          # k3-tiny's experts differ by noise
    lo, hi, _, _ = _colour_range(snrs)
    assert hi - lo == pytest.approx(3.0) and (lo + hi) / 2 == pytest.approx(float(np.median(snrs)))
    svg = render_svg(report)
    assert "span 3.0 dB" in svg and "median-centred" in svg
    # noise no longer paints the whole scale: every cell sits near its middle (was 0 to 1)
    assert all(0.4 < (v - lo) / (hi - lo) < 0.6 for v in snrs)


def test_heatmap_marks_experts_kept_in_mxfp4(tiny_reports):
    from k3ckpt.requant.heatmap import kept_cells

    plain, mixed = tiny_reports
    assert kept_cells(plain) == {}
    kept = kept_cells(mixed)
    n_kept = sum(1 for r in mixed.tensors if r.format == "mxfp4-pack-quantized")
    assert kept and sum(kept.values()) == n_kept > 0
    root = ET.fromstring(render_svg(mixed))
    marks = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "kept"]
    assert len(marks) == 1 and len(list(marks[0])) == len(kept)
    titles = [t.text for t in root.iter(f"{SVG_NS}title") if t.text and "kept in MXFP4" in t.text]
    assert len(titles) == len(kept)
