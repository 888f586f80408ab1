"""Small checkpoints for hub tests, written with k3ckpt's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from k3ckpt.io import ShardedWriter, TensorSpec, save_file

INDEX = "model.safetensors.index.json"


def toy_tensors(seed: int, *, bulk: int = 96 << 10) -> dict[str, np.ndarray]:
    """A few dtypes, a scalar, an empty tensor and ``bulk`` bytes of U8 data."""
    rng = np.random.default_rng(seed)
    return {
        f"model.layers.{seed}.w": rng.standard_normal((16, 24)).astype(np.float32),
        f"model.layers.{seed}.bf": rng.standard_normal((8, 12)).astype(ml_dtypes.bfloat16),
        f"model.layers.{seed}.blocks": rng.integers(0, 256, (bulk // 64, 64), dtype=np.uint8),
        f"model.layers.{seed}.step": np.array(seed, np.int64),
        f"model.layers.{seed}.empty": np.zeros((0, 4), np.float16),
    }


def write_sharded(dst: Path, shards: int = 3, *, seed: int = 0, config: dict | None = None,
                  bulk: int = 96 << 10) -> dict[str, np.ndarray]:
    """``shards`` shards + index (+ config.json); returns the tensors written."""
    tensors: dict[str, np.ndarray] = {}
    for i in range(shards):
        tensors.update(toy_tensors(seed + i, bulk=bulk))
    specs = [TensorSpec(n, _dtype(a), a.shape) for n, a in tensors.items()]
    per = sum(a.nbytes for a in tensors.values()) // shards + 1
    with ShardedWriter(dst, specs, max_shard_bytes=per, metadata={"format": "pt"}, write_index=True) as w:
        for n, a in tensors.items():
            w.write(n, a)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return tensors


def write_single(path: Path, *, seed: int = 0) -> dict[str, np.ndarray]:
    t = toy_tensors(seed)
    save_file(path, t, metadata={"format": "pt"})
    return t


def write_index(dst: Path, weight_map: dict[str, str]) -> None:
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _dtype(a: np.ndarray) -> str:
    from k3ckpt.io import dtypes

    return dtypes.from_numpy(a.dtype)
