"""Build disk space: a build whose artifact will not fit on the output's file system is refused before it writes.

The artifact's size is estimated from the checkpoint's shapes and the recipe's quantization (compiler/build.py
`_estimates`, "artifact_bytes": the weights as stored) plus `SLACK` for the graph, tokenizer and manifest. The
build writes into a staging folder beside the final one (same file system, renamed at the end), so the space
that counts is the free space where the output folder is, or would be created.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from compiler.memory import GIB, refuse_unless_forced

SLACK = 64 << 20  # model.onnx's graph, tokenizer/, runtime.json, manifest: beyond the stored weights
MARGIN = 1.05  # the weight estimate is exact for float and packed INT4 tensors; headroom for the rest


def disk_free(path: Path) -> tuple[Path, int] | None:
    """(the nearest existing folder at or above `path`, its file system's free bytes), or None if unknown."""
    p = path.resolve()
    while not p.exists():
        if p.parent == p:
            return None
        p = p.parent
    try:
        return p, shutil.disk_usage(p).free
    except OSError:
        return None


def needed_bytes(artifact_bytes: int) -> int:
    return int(artifact_bytes * MARGIN) + SLACK


def check_disk(output: Path, artifact_bytes: int, force: bool = False) -> str | None:
    """None when an artifact of `artifact_bytes` (estimated) fits the free space at `output` (or the space is
    unknown, or `force`); else the reason, naming both sizes and the folder."""
    free = disk_free(output)
    need = needed_bytes(artifact_bytes)
    if free is None or need <= free[1]:
        return None
    folder, have = free
    return refuse_unless_forced(
        f"the artifact needs an estimated {need / GIB:.2f} GiB on disk ({artifact_bytes / GIB:.2f} GiB of "
        f"weights), but {folder} has {have / GIB:.2f} GiB free",
        "free space there, build to another folder (-o DIR), or pass --force to build anyway", force)
