"""The files beside a checkpoint's weights (tokenizer, chat template, generation config, ...):
copied into every output that is a checkpoint again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

__all__ = ["copy_side_files", "is_weight_file"]


def copy_side_files(src_root: Path | None, dst: Path, *, skip: Callable[[str], bool]) -> list[str]:
    """Copy the files beside the weights (tokenizer, generation config, ...) that ``skip`` does not claim."""
    if src_root is None or not src_root.is_dir():
        return []
    copied = []
    for p in sorted(src_root.iterdir()):
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".") and not skip(p.name):
            tmp = dst / f".{p.name}.partial"
            shutil.copyfile(p, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst / p.name)
            copied.append(p.name)
    return copied


def is_weight_file(name: str) -> bool:
    """Weights, their index, or config.json: what an output writes itself rather than copies."""
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json") or name == "config.json"
