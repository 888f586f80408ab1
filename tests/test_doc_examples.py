"""Every `k3ckpt ...` command shown in README.md and docs/ runs as written.

The commands of one page run in order in one scratch folder, so a page's
`fixture`, `plan -o plan.json` and `shard --plan plan.json` feed each other as
they do for a reader.  Synopsis placeholders take a fixture's value (SRC and
PATH: the tiny K3; DST: a fresh output folder per writing command, and the last
one written for `report`/`verify`); optional `[...]` groups are left out.  A
command is skipped only when it needs what this machine lacks (the Hub, a GPU),
and the skip says which; a placeholder with no value here fails the test.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ENV_ROOT = str(ROOT)

FENCE = re.compile(r"^```")
COMMAND = re.compile(r"^(?:\$ )?k3ckpt(?:\s|$)")
OPTIONAL = re.compile(r"\s*\[[^\[\]]*\]")
# A synopsis placeholder: an all-caps word (SRC, DST, SPEC ...), not an option value like 64xGB200.
PLACEHOLDER = re.compile(r"(?<![\w/.-])[A-Z][A-Z0-9_]*(?![\w.-])")
VALUES = {"SPEC": "8xH100"}                # other synopsis words, as a reader would fill them in
WRITERS = {"dequant", "requant", "shard"}   # commands whose second argument is a new output folder
SLOW_PAGES = ROOT / "docs" / "examples"    # worked examples plan the full-size K3: minutes each


def _code_lines(text: str) -> list[str]:
    """The lines of fenced and indented code blocks, with `\\` continuations joined."""
    out: list[str] = []
    fenced = False
    pending = ""
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            code = line.strip()
        elif line.startswith("    ") or line.startswith("\t"):
            code = line.strip()
        else:
            pending = ""
            continue
        if pending:
            code = pending + " " + code
            pending = ""
        if code.endswith("\\"):
            pending = code[:-1].rstrip()
            continue
        out.append(code)
    return out


def page_commands(page: Path) -> list[str]:
    return [line for line in _code_lines(page.read_text()) if COMMAND.match(line)]


def _cases():
    for page in PAGES:
        cmds = page_commands(page)
        if not cmds:
            continue
        marks = [pytest.mark.slow] if SLOW_PAGES in page.parents else []
        yield pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks)


class Runner:
    """Runs one page's commands in order, with its placeholders bound."""

    def __init__(self, cwd: Path, src: Path):
        self.cwd = cwd
        self.src = src
        self.last_output: str | None = None
        self.written: dict[str, list[str]] = {}
        self.ran: list[str] = []
        self.skipped: list[str] = []

    def bind(self, line: str) -> list[str] | None:
        line = re.sub(r"^\$ ", "", line)
        line = OPTIONAL.sub("", line)
        args = shlex.split(line, comments=True)[1:]
        if not args:
            return []
        cmd = args[0]
        if any(a.startswith("hf://") for a in args) or "--push-to-hub" in args:
            self.skipped.append(f"{line}  (needs the Hub)")
            return None
        if "--ray" in args:      # tests/test_ray.py runs --ray on a local cluster
            self.skipped.append(f"{line}  (needs a Ray cluster)")
            return None
        bound: list[str] = []
        positional = 0
        for i, a in enumerate(args):
            if i and args[i - 1] == "--imatrix":   # an importance matrix made for the fixture
                a = str(self._imatrix())
            elif a.startswith("/tmp/"):       # a reader's scratch path: keep it inside this test's folder
                a = a[len("/tmp/"):]
            if a in ("SRC", "PATH"):
                a = str(self.src)
            elif a == "DST":
                if cmd in WRITERS and positional == 2:
                    a = self._output(cmd, args)
                elif self.last_output is not None:
                    a = self.last_output
            elif a in VALUES:
                a = VALUES[a]
            elif PLACEHOLDER.fullmatch(a):
                raise AssertionError(f"`{line}`: no fixture value stands for {a} (add it to VALUES)")
            if not a.startswith("-"):
                positional += 1
            bound.append(a)
        return bound

    def _imatrix(self) -> Path:
        """An importance matrix covering the fixture's routed experts, named as llama-imatrix
        names them (``blk.L.ffn_*_exps.weight``, one row per expert)."""
        path = self.cwd / "fixture.imatrix.gguf"
        if not path.exists():
            import numpy as np

            from k3ckpt import api
            from k3ckpt.requant.importance import entry_name
            from test_imatrix import write_gguf

            shapes: dict[str, list[int]] = {}
            for w in api.requant(self.src, self.cwd / "unused", format="gguf-q2_k", dry_run=True).plan.weights:
                n = shapes.setdefault(entry_name(w.layer, w.expert, w.projection), [0, w.shape[1]])
                n[0] = max(n[0], w.expert + 1)
            rng = np.random.default_rng(0)
            write_gguf(path, {name: (rng.lognormal(0, 1, (e, k)).astype(np.float32), np.ones(e, np.float32))
                              for name, (e, k) in shapes.items()})
        return path

    def _output(self, cmd: str, args: list[str]) -> str:
        """A writer's DST: its earlier one to resume, else a new folder; a dry run's is not kept
        for the `report` / `verify` that follow, since it writes nothing."""
        if "--resume" in args and self.written.get(cmd):
            return self.written[cmd][-1]
        name = f"{cmd}-out-{len(self.written.get(cmd, [])) + 1}"
        if "--dry-run" not in args:
            self.written.setdefault(cmd, []).append(name)
            self.last_output = name
        return name

    def run(self, line: str) -> None:
        args = self.bind(line)
        if args is None:
            return
        proc = subprocess.run([sys.executable, "-m", "k3ckpt", *args], cwd=self.cwd, capture_output=True,
                              text=True, timeout=900, stdin=subprocess.DEVNULL,
                              env={**_env(), "PYTHONPATH": ENV_ROOT})
        assert proc.returncode == 0, (f"`{line}` (run as `k3ckpt {shlex.join(args)}`) exited "
                                      f"{proc.returncode}:\n{proc.stderr[-2000:]}")
        self.ran.append(line)


def _env():
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HUB_OFFLINE": "1"}


def test_pages_show_commands():
    """The collector finds the README's commands (so an empty parametrization cannot pass)."""
    readme = page_commands(ROOT / "README.md")
    assert any(c.startswith("k3ckpt inspect") for c in readme)
    assert any(c.startswith("k3ckpt plan") for c in readme)
    assert len(readme) >= 10


def test_binding_rules(tmp_path):
    r = Runner(tmp_path, tmp_path / "src")
    assert r.bind("k3ckpt dequant SRC DST --dtype bf16 [--tensors REGEX]") == [
        "dequant", str(tmp_path / "src"), "dequant-out-1", "--dtype", "bf16"]
    assert r.bind("k3ckpt dequant SRC DST --dry-run")[2] == "dequant-out-2"
    assert r.bind("k3ckpt verify DST [--source SRC]") == ["verify", "dequant-out-1"]
    assert r.bind("k3ckpt fixture k3-virtual /tmp/k3   # sparse") == ["fixture", "k3-virtual", "k3"]
    assert r.bind("k3ckpt inspect hf://org/model") is None and "Hub" in r.skipped[-1]
    assert r.bind("k3ckpt plan SRC --devices SPEC")[2:] == ["--devices", "8xH100"]
    with pytest.raises(AssertionError, match="WHAT"):
        r.bind("k3ckpt inspect WHAT")
    assert r.bind("k3ckpt plan SRC --devices 64xGB200 -o plan.json")[2:4] == ["--devices", "64xGB200"]


@pytest.mark.parametrize("page", list(_cases()))
def test_page_commands_run_as_written(page, k3_tiny, tmp_path):
    runner = Runner(tmp_path, Path(k3_tiny))
    for line in page_commands(page):
        runner.run(line)
    if not runner.ran:
        pytest.skip("; ".join(runner.skipped))
    if runner.skipped:
        print(f"{page.name}: skipped", *runner.skipped, sep="\n  ")
