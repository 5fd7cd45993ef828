"""Checkpoint: a directory of files that a run saved (names and meanings as in Ray Train)."""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from jaxtrain.storage import MANIFEST_NAME, download_checkpoint, download_tree


class Checkpoint:
    """A checkpoint directory.

    In the training function, ``Checkpoint.from_directory(d)`` names files to save with
    ``report(metrics, checkpoint=...)``: they are read (or, above the snapshot budget, copied) when
    ``report`` is called, so ``d`` may be reused or deleted afterwards. ``get_checkpoint()``,
    ``Result.checkpoint`` and ``Result.best_checkpoints`` return committed checkpoints, whose
    directory also holds the manifest ``.jaxtrain_manifest.json`` (files, sizes, checksums).
    """

    def __init__(self, path: str | os.PathLike, filesystem: Any = None) -> None:
        self.path: str = os.fspath(path)
        # The fsspec filesystem of a remote checkpoint; None for a local (or NFS) path.
        self.filesystem = filesystem
        # A view in host memory (checkpoint_memory.py) whose files not held there are links to
        # the committed checkpoint: that checkpoint, which to_directory() copies instead.
        self._source: str | None = None
        # In a worker: the rank whose files a download of a remote checkpoint fetches first.
        self._rank: int | None = None

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        return cls(os.path.abspath(os.fspath(path)))

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copies the checkpoint's files (not its manifest) into ``path`` (default: a new
        temporary directory) and returns that path; a remote checkpoint is downloaded.

        Files keep their modes (never wider than the umask) and symbolic links that point inside
        the checkpoint stay links; a link that points outside it is refused with a ValueError
        naming the link and its target, and never followed."""
        target = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="checkpoint-")
        if self.filesystem is not None:
            if self.filesystem.exists(posixpath.join(self.path, MANIFEST_NAME)):
                # A committed checkpoint: what its manifest lists, checked, this rank's first.
                download_checkpoint(self.filesystem, self.path, target, self._rank)
            else:
                download_tree(self.filesystem, self.path, target, skip=(MANIFEST_NAME,))
            return target
        from jaxtrain import _core

        had_manifest = os.path.lexists(os.path.join(target, MANIFEST_NAME))
        # The engine's copy: the same rules for modes and links as report(checkpoint=...).
        _core.stage_directory(self._source or self.path, target)
        if not had_manifest and os.path.lexists(os.path.join(target, MANIFEST_NAME)):
            os.unlink(os.path.join(target, MANIFEST_NAME))
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint as a local directory, for reading: a local checkpoint's own directory
        (no copy), or a temporary download of a remote one, removed afterwards."""
        if self.filesystem is None:
            yield self.path
            return
        target = self.to_directory()
        try:
            yield target
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        if self.filesystem is None:
            return f"Checkpoint(path={self.path!r})"
        return f"Checkpoint(filesystem={type(self.filesystem).__name__}, path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Checkpoint) and other.path == self.path
                and other.filesystem is self.filesystem)

    def __hash__(self) -> int:
        return hash(self.path)
