"""Each GGUF tensor's type: --tensor-type overrides, --fallback-type, --target-bpw (gguf/choose.py)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from k3ckpt.errors import ShapeError, UsageError
from k3ckpt.gguf.choose import _sample
from k3ckpt.gguf.convert import plan_gguf_types, write_gguf
from k3ckpt.gguf.produce import expert_piece
from k3ckpt.gguf.tensors import F32, IQ2_XS, MXFP4, Q8_0
from k3ckpt.io.reader import open_checkpoint


def _types(planned):
    return {p.info.name: p.info.ggml_type for p in planned}


def _expert_bpw(planned) -> float:
    ex = [p for p in planned if p.recipe.kind == "experts"]
    return 8 * sum(p.info.nbytes for p in ex) / sum(math.prod(p.info.shape) for p in ex)


def test_overrides_first_match_wins_on_gguf_or_source_names(k3_tiny):
    with open_checkpoint(k3_tiny) as ckpt:
        _, base, _, _ = plan_gguf_types(ckpt)
        _, planned, _, choice = plan_gguf_types(ckpt, tensor_type=[
            r"blk\.1\.ffn_down_exps=Q8_0",                 # a GGUF name, ggml's spelling in capitals
            r"ffn_down_exps=mxfp4",                        # the other layers' down projections
            r"block_sparse_moe\.shared_experts\.down_proj=q8_0",   # a source name
            r"ffn_down=bf16"])                             # matches only what the rules above did not take
    got, was = _types(planned), _types(base)
    downs = sorted(n for n in got if n.endswith("ffn_down_exps.weight"))
    assert got["blk.1.ffn_down_exps.weight"] == Q8_0
    assert {got[n] for n in downs if n != "blk.1.ffn_down_exps.weight"} == {MXFP4}
    assert {t for n, t in got.items() if n.endswith("ffn_down_shexp.weight")} == {Q8_0}
    assert {t for n, t in got.items() if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight"))} == {IQ2_XS}
    # 1-D tensors and norms are never overridden; everything no rule matched is as planned
    changed = {n for n in got if got[n] != was[n]}
    assert changed == {n for n, _ in choice.overridden} - {n for n in got if got[n] == was[n]}
    assert all(was[n] == F32 for n in got if n.endswith("_norm.weight"))
    assert dict(choice.overridden)["blk.1.ffn_down_exps.weight"] == "q8_0"


def test_bad_overrides_are_one_line_errors(k3_tiny):
    with open_checkpoint(k3_tiny) as ckpt:
        with pytest.raises(UsageError, match="must be REGEX=TYPE"):
            plan_gguf_types(ckpt, tensor_type=["ffn_down_exps"])
        with pytest.raises(UsageError, match="'q4_k' is not one of bf16, f16, f32, iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_xxs, mxfp4, q2_k, q8_0"):
            plan_gguf_types(ckpt, tensor_type=["ffn_down_exps=q4_k"])
        with pytest.raises(UsageError, match="bad --tensor-type regular expression"):
            plan_gguf_types(ckpt, tensor_type=["ffn_(=q8_0"])
        with pytest.raises(UsageError, match="'no_such_tensor' matches no tensor"):
            plan_gguf_types(ckpt, tensor_type=["ffn_down_exps=q8_0", "no_such_tensor=q8_0"])
        with pytest.raises(UsageError, match="--fallback-type 'q3' is not one of"):
            plan_gguf_types(ckpt, fallback_type="q3")


def test_fallback_only_where_the_type_does_not_fit_and_only_when_asked(kimi_k2_tiny, tmp_path):
    """The tiny K2's down projections have rows of 192: IQ2_XS (blocks of 256) cannot hold them."""
    with open_checkpoint(kimi_k2_tiny) as ckpt:
        with pytest.raises(ShapeError, match="rows of 192 values do not split into iq2_xs"):
            plan_gguf_types(ckpt, expert_type="iq2_xs")
        with pytest.raises(ShapeError, match="--fallback-type iq2_xs does not fit either"):
            plan_gguf_types(ckpt, expert_type="iq2_xs", fallback_type="iq2_xs")
        _, planned, _, choice = plan_gguf_types(ckpt, expert_type="iq2_xs", fallback_type="q8_0")
        got = _types(planned)
        downs = sorted(n for n in got if n.endswith("ffn_down_exps.weight"))
        assert {got[n] for n in downs} == {Q8_0}
        assert {got[n] for n in got if n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight"))} == {IQ2_XS}
        assert sorted(choice.fallbacks) == sorted((n, "iq2_xs", "q8_0") for n in downs)
        res = write_gguf(ckpt, tmp_path / "k2.gguf", expert_type="iq2_xs", fallback_type="q8_0")
    written = {t.name: int(t.tensor_type) for t in gguf.GGUFReader(res.paths[0]).tensors}
    assert {written[n] for n in downs} == {Q8_0}


def test_target_bpw_keeps_the_most_error_per_byte_as_mxfp4(k3_tiny, tmp_path):
    two = ["iq2_xs", "mxfp4"]            # the expert type or its lossless repack
    with open_checkpoint(k3_tiny) as ckpt:
        _, low, _, _ = plan_gguf_types(ckpt)
        lo = _expert_bpw(low)
        hi = 4.25
        target = round(lo + 0.4 * (hi - lo), 3)
        _, planned, _, choice = plan_gguf_types(ckpt, target_bpw=target, target_types=two)
        alloc = choice.allocation
        assert alloc.keep and alloc.bpw == pytest.approx(_expert_bpw(planned), abs=1e-12)
        assert alloc.bpw <= target + 1e-9
        got = _types(planned)
        assert {n for n, t in got.items() if t == MXFP4} == set(alloc.keep)
        # the measure behind the choice, by hand: squared error on the sampled experts, scaled up
        experts = [p for p in low if p.recipe.kind == "experts"]
        per_byte = {}
        for p in experts:
            picks = _sample(p.recipe.arg, 8)
            sse = 0.0
            for e in picks:
                s = expert_piece(ckpt, p, e, measure=True).result.stats
                sse += s.count * s.err_rms ** 2
            extra = math.prod(p.info.shape) * 4.25 / 8 - p.info.nbytes
            per_byte[p.info.name] = sse * p.recipe.arg / len(picks) / extra
        kept_min = min(per_byte[n] for n in alloc.keep)
        left = [per_byte[n] for n in per_byte if n not in alloc.keep]
        # greedy by error per byte: every tensor left at IQ2_XS removes less per byte than the least
        # kept one, unless it was too big for what was left of the budget (all are the same size here)
        assert max(left) <= kept_min
        assert alloc.by_type() == {"IQ2_XS": len(experts) - len(alloc.keep), "MXFP4": len(alloc.keep)}
        res = write_gguf(ckpt, tmp_path / "mixed.gguf", target_bpw=target, target_types="iq2_xs,mxfp4")
    written = {t.name: int(t.tensor_type) for t in gguf.GGUFReader(res.paths[0]).tensors}
    assert {n for n, t in written.items() if t == MXFP4} == set(alloc.keep)


def test_target_bpw_limits_and_sources(k3_tiny, kimi_k2_tiny):
    with open_checkpoint(k3_tiny) as ckpt:
        with pytest.raises(UsageError, match=r"--target-bpw 1.5 is below what the expert types need \(1.5625 bpw\)"):
            plan_gguf_types(ckpt, target_bpw=1.5)
        with pytest.raises(UsageError, match="--target-types 'q4_k' is not one of"):
            plan_gguf_types(ckpt, target_bpw=2.0, target_types="iq1_s,q4_k")
        # pinned tensors keep their type and count at their size
        _, planned, _, choice = plan_gguf_types(ckpt, target_bpw=3.0, tensor_type=[r"ffn_down_exps=iq2_xs"])
        assert all(t == IQ2_XS for n, t in _types(planned).items() if n.endswith("ffn_down_exps.weight"))
        assert not any(n.endswith("ffn_down_exps.weight") for n in choice.allocation.keep)
        assert _expert_bpw(planned) <= 3.0 + 1e-9
        _, dry, _, choice = plan_gguf_types(ckpt, target_bpw=3.0, measure=False)
        assert choice.allocation is None and MXFP4 not in _types(dry).values()
    with open_checkpoint(kimi_k2_tiny) as ckpt:
        with pytest.raises(UsageError, match="--target-types mxfp4 is a lossless repack, so it needs MXFP4 experts"):
            plan_gguf_types(ckpt, expert_type="bf16", target_bpw=6.0, target_types=["q2_k", "mxfp4"])


def test_target_bpw_chooses_across_the_family(k3_tiny, kimi_k2_tiny, tmp_path):
    # --target-bpw 1.75 (K3's smallest GGUFs are about 1.3-1.6 bpw; the fixture's 9 stacked tensors
    # are a ninth of the experts each, so it needs more room than 1.6 for a second type): every
    # expert tensor takes one of the family's types, the average is at most the target and within
    # one tensor's largest step of it, and the file holds the chosen types (the greedy itself:
    # tests/test_allocate.py)
    from k3ckpt.gguf.choose import TARGET_FAMILY

    with open_checkpoint(k3_tiny) as ckpt:
        _, planned, _, choice = plan_gguf_types(ckpt, target_bpw=1.75)
        alloc = choice.allocation
        experts = {p.info.name: p for p in planned if p.recipe.kind == "experts"}
        assert set(dict(alloc.types)) == set(experts) and not alloc.weighted
        assert {p.info.ggml_type for p in experts.values()} <= set(TARGET_FAMILY)
        assert alloc.bpw == pytest.approx(_expert_bpw(planned), abs=1e-12) and alloc.bpw <= 1.75 + 1e-9
        params = sum(math.prod(p.info.shape) for p in experts.values())
        step = max(math.prod(p.info.shape) for p in experts.values()) * (4.25 - 1.5625) / params
        assert alloc.bpw > 1.75 - step
        assert alloc.by_type().get("IQ1_S", 0) > 0 and len(alloc.by_type()) >= 2
        res = write_gguf(ckpt, tmp_path / "k3-mix.gguf", target_bpw=1.75)
    written = {t.name: t.tensor_type.name for t in gguf.GGUFReader(res.paths[0]).tensors}
    assert {n: written[n] for n in experts} == dict(alloc.types)
    assert res.allocation["by_type"] == alloc.by_type() and res.allocation["bpw"] == alloc.bpw
    assert res.to_dict()["allocation"]["types"] == dict(alloc.types)
    # a block-FP8 source has no lossless option, so the family leaves mxfp4 out; the fixture's
    # ffn_down rows of 192 hold none of the family's 256-blocks, so those keep --expert-type
    with open_checkpoint(kimi_k2_tiny) as ckpt:
        _, planned, _, choice = plan_gguf_types(ckpt, expert_type="q8_0", target_bpw=8.5)
    types = {p.info.name: p.info.ggml_type for p in planned if p.recipe.kind == "experts"}
    down = {n for n in types if n.endswith("ffn_down_exps.weight")}
    assert down and {types[n] for n in down} == {Q8_0}
    assert {types[n] for n in set(types) - down} <= set(TARGET_FAMILY) - {MXFP4}
    assert choice.allocation.by_type()["Q8_0"] == len(down)


def test_sample_spreads_over_the_experts():
    assert _sample(16, 8) == [0, 2, 4, 6, 9, 11, 13, 15]
    assert _sample(3, 8) == [0, 1, 2]
    assert _sample(1, 8) == [0]
    assert np.all(np.diff(_sample(896, 8)) > 100)


def test_chat_template_file_sets_or_replaces_the_sources(k3_tiny, tmp_path):
    from k3ckpt.gguf.convert import plan_gguf_types

    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}", encoding="utf-8")
    with open_checkpoint(k3_tiny) as ckpt:
        kvs, _, _, _ = plan_gguf_types(ckpt)
        own = [kv.value for kv in kvs if kv.key == "tokenizer.chat_template"]
        kvs, _, _, _ = plan_gguf_types(ckpt, chat_template=tpl)
        got = [kv.value for kv in kvs if kv.key == "tokenizer.chat_template"]
        assert got == [tpl.read_text()] and got != own
        for bad, match in ((tmp_path / "none.jinja", "no such file"), (tmp_path, "cannot be read")):
            with pytest.raises(UsageError, match=match):
                plan_gguf_types(ckpt, chat_template=bad)
        (tmp_path / "empty.jinja").write_text("  \n")
        with pytest.raises(UsageError, match="is empty"):
            plan_gguf_types(ckpt, chat_template=tmp_path / "empty.jinja")
        res = write_gguf(ckpt, tmp_path / "t.gguf", chat_template=tpl, expert_type="mxfp4")
    field = gguf.GGUFReader(res.paths[0]).fields["tokenizer.chat_template"]
    assert field.contents() == tpl.read_text()
