"""Building a fixture on a full disk, after a failed build, and over an existing folder:
free space is checked first, the build lands in a hidden folder beside DST and is moved in
when complete, so DST never holds a half fixture; errors say the fix in the caller's terms."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from k3ckpt.errors import DiskSpaceError, Hint, OutputExistsError
from k3ckpt.fixtures import fixture_spec, make_fixture
from k3ckpt.fixtures.build import fixture_disk_bytes, staging_dir
from k3ckpt.io import open_checkpoint

Usage = namedtuple("Usage", "total used free")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _total(name: str) -> int:
    from k3ckpt.fixtures.sources import SOURCE_FIXTURES, source_fixture

    return (source_fixture(name) if name in SOURCE_FIXTURES else fixture_spec(name)).total_bytes


def _fake_free(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(real(p).total, 0, free))


def test_disk_bytes_are_what_the_build_writes(tmp_path):
    spec = fixture_spec("k3-tiny")
    need = fixture_disk_bytes(spec)
    path = make_fixture("k3-tiny", tmp_path / "x")
    on_disk = sum(p.stat().st_size for p in path.iterdir())
    assert on_disk <= need <= on_disk + (1 << 20)   # exact shards, a margin for the side files


def test_too_little_free_space_writes_nothing(tmp_path, monkeypatch):
    need = fixture_disk_bytes(fixture_spec("k3-tiny"))
    _fake_free(monkeypatch, need // 2)   # room for some shards, not all: this used to write shards 1-2
    with pytest.raises(DiskSpaceError, match=f"needs {need:,} bytes"):
        make_fixture("k3-tiny", tmp_path / "x")
    assert _files(tmp_path) == []
    monkeypatch.undo()
    path = make_fixture("k3-tiny", tmp_path / "x")
    with open_checkpoint(path) as ck:
        assert len(ck.shards) == 7


@pytest.mark.parametrize("name", ["k3-tiny", "nvfp4-tiny"])
def test_a_build_that_fails_midway_leaves_nothing_and_reruns(tmp_path, monkeypatch, name):
    from k3ckpt.io.writer import ShardedWriter, pwrite_all

    calls = []

    def full(fd, view, offset):
        calls.append(offset)
        if len(calls) > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        pwrite_all(fd, view, offset)

    monkeypatch.setattr(ShardedWriter, "_pwrite_all", staticmethod(full))
    with pytest.raises(OSError, match="No space left"):
        make_fixture(name, tmp_path / "x")
    assert _files(tmp_path) == []
    monkeypatch.undo()
    path = make_fixture(name, tmp_path / "x")
    with open_checkpoint(path) as ck:
        assert ck.total_size == _total(name)


def test_a_killed_build_is_replaced_by_the_rerun(tmp_path):
    dst = tmp_path / "x"
    stage = staging_dir(dst)
    stage.mkdir()
    (stage / ".k3ckpt-fixture").write_text("k3-tiny\n")   # what a killed run leaves
    (stage / "model-00001-of-000007.safetensors").write_bytes(b"half")
    path = make_fixture("k3-tiny", dst)
    assert not stage.exists() and ".k3ckpt-fixture" not in _files(path)
    with open_checkpoint(path) as ck:
        assert len(ck.shards) == 7
    # a folder of that name that we did not make is left alone
    stage.mkdir()
    (stage / "mine.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="not a k3ckpt fixture build"):
        make_fixture("k3-tiny", tmp_path / "x", overwrite=True)
    assert (stage / "mine.txt").read_text() == "keep"


def test_overwrite_replaces_in_place_and_keeps_other_files(tmp_path):
    dst = make_fixture("k3-tiny", tmp_path / "x", layers=3, experts=2)
    (dst / "notes.txt").write_text("mine")
    make_fixture("k3-tiny", dst, layers=2, experts=2, overwrite=True)
    assert (dst / "notes.txt").read_text() == "mine" and not staging_dir(dst).exists()
    with open_checkpoint(dst) as ck:
        assert len(ck.shards) == 5


def test_existing_folder_error_names_the_argument_for_the_api(tmp_path):
    dst = make_fixture("k3-tiny", tmp_path / "x")
    with pytest.raises(OutputExistsError) as exc:
        make_fixture("k3-tiny", dst)
    assert exc.value.hint == Hint("overwrite", True, "to rebuild the fixture there")
    assert str(exc.value) == f"{dst}: folder is not empty; pass overwrite=True to rebuild the fixture there"
    with pytest.raises(OutputExistsError, match="not a folder"):
        (tmp_path / "f").write_text("")
        make_fixture("k3-tiny", tmp_path / "f")


def test_existing_folder_error_names_the_flag_for_the_cli(tmp_path, capsys):
    from k3ckpt.cli.main import main

    dst = make_fixture("k3-tiny", tmp_path / "x")
    assert main(["fixture", "k3-tiny", str(dst)]) == 2
    err = capsys.readouterr().err
    assert err == f"k3ckpt: error: {dst}: folder is not empty; pass --overwrite to rebuild the fixture there\n"
    assert main(["fixture", "k3-tiny", str(dst), "--overwrite"]) == 0
    assert f"wrote k3-tiny to {dst}" in capsys.readouterr().out


def test_virtual_k3_into_a_full_folder_says_overwrite(tmp_path):
    from k3ckpt.fixtures import make_virtual_k3

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.txt").write_text("")
    with pytest.raises(OutputExistsError) as exc:
        make_virtual_k3(tmp_path / "x")
    assert exc.value.hint == Hint("overwrite", True, "to rebuild the fixture there")
    assert _files(tmp_path) == ["x", "x/a.txt"]
