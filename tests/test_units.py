"""``k3ckpt.units``: sizes people type, durations people read."""

from __future__ import annotations

import re

import pytest

from k3ckpt.cli.main import main
from k3ckpt.errors import UsageError
from k3ckpt.units import human_duration, parse_size


def test_durations_in_the_unit_that_reads():
    assert human_duration(18267) == "5.1 h" and human_duration(59) == "59.0 s" and human_duration(60) == "1.0 min"


def test_sizes_without_a_unit_are_refused():
    with pytest.raises(UsageError, match=r"give a unit, e\.g\. 512GB"):
        parse_size("512", "--host-dram")


def test_requant_dry_run_estimate_is_a_human_duration(k3_tiny, tmp_path, capsys):
    assert main(["requant", str(k3_tiny), str(tmp_path / "o"), "--format", "moet-w2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"estimated (?:about )?([0-9.]+) (ms|s|min|h|d)\b", out)
    assert m, out
    assert not (tmp_path / "o").exists()
