"""Folders in the cache written once and atomically (converted models, GGUF metadata)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_folder_once(target: Path, write: Callable[[Path], None], marker: str) -> Path:
    """`target`, filled by `write(folder)` in a temporary sibling and renamed into place
    unless `target/marker` already exists: a crash mid-way leaves no half-written folder,
    and of two processes racing, the loser keeps the winner's folder."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
