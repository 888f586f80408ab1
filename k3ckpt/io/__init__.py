"""Strict safetensors I/O: header parser, bounded-memory reader, atomic sharded writer.

See ``docs/safetensors-io.md`` for the rules we enforce.
"""

from __future__ import annotations

from .header import (
    MAX_HEADER_BYTES,
    Header,
    TensorInfo,
    build_header,
    parse_header_json,
    parse_header_length,
    read_header,
)
from .reader import (
    ByteSource,
    Checkpoint,
    LocalFile,
    TensorEntry,
    check_shard_name,
    checkpoint_from_sources,
    load_config,
    open_checkpoint,
    parse_index,
)
from .writer import ShardedWriter, TensorSpec, save_file

__all__ = [
    "MAX_HEADER_BYTES",
    "Header",
    "TensorInfo",
    "build_header",
    "parse_header_json",
    "parse_header_length",
    "read_header",
    "ByteSource",
    "Checkpoint",
    "LocalFile",
    "TensorEntry",
    "check_shard_name",
    "checkpoint_from_sources",
    "load_config",
    "open_checkpoint",
    "parse_index",
    "ShardedWriter",
    "TensorSpec",
    "save_file",
]
