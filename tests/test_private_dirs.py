"""Directories jaxtrain makes under locations other users share (jaxtrain.private_dirs), and the
staging of a store run's checkpoint parts in one (the review's N1): a directory another user made
first, or left open, is refused; a part changed after it was staged is not vouched for.

The tests run as root: another user's directory is one chowned to uid 65534."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import stat
import tempfile
import uuid
from pathlib import Path

import fsspec
import pytest

from jaxtrain import _core, private_dirs
from jaxtrain.worker import stager
from jaxtrain.worker.checkpoint_store import Store, StoreError

OTHER_UID = 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_each_level_is_made_private(tmp_path):
    made = private_dirs.private_dir(str(tmp_path), "a", "b", "c")
    assert made == str(tmp_path / "a" / "b" / "c")
    for level in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert _mode(level) == 0o700 and os.lstat(level).st_uid == os.geteuid()
    assert private_dirs.private_dir(str(tmp_path), "a", "b", "c") == made  # checked, kept


@pytest.mark.parametrize("what", ["another user's", "open to others", "a link", "a file"])
def test_a_level_that_is_not_this_users_alone_is_refused(tmp_path, what):
    level = tmp_path / "a"
    if what == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        level.symlink_to(tmp_path / "elsewhere")
    elif what == "a file":
        level.write_text("")
    else:
        level.mkdir(mode=0o700)
        if what == "another user's":
            os.chown(level, OTHER_UID, OTHER_UID)
        else:
            level.chmod(0o755)
    problem = {"another user's": f"another user \\(uid {OTHER_UID}\\) owns it",
               "open to others": "other users may enter it",
               "a link": "it is a symbolic link", "a file": "it is not a directory"}[what]
    with pytest.raises(PermissionError, match=f"'{level}' is not a private directory of this "
                       f"user's .*{problem}"):
        private_dirs.private_dir(str(tmp_path), "a", "b")
    assert not (tmp_path / "elsewhere" / "b").exists()  # nothing made through the link


def test_a_location_where_others_may_replace_entries_is_refused(tmp_path):
    tmp_path.chmod(0o777)
    with pytest.raises(PermissionError, match="lets other users replace what is in it"):
        private_dirs.private_dir(str(tmp_path), "a")
    tmp_path.chmod(0o1777)  # sticky, as /tmp
    private_dirs.private_dir(str(tmp_path), "a")


def test_open_beneath_follows_no_link_and_checks_the_owner(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("mine")
    (tmp_path / "secret").write_text("key")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "secret")
    (tmp_path / "dirlink").symlink_to(tmp_path / "d")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with os.fdopen(private_dirs.open_beneath(fd, "d/f", owner=os.geteuid())) as f:
            assert f.read() == "mine"
        for rel in ("d/link", "dirlink/f", "../x", "d/../secret"):
            with pytest.raises(PermissionError):
                private_dirs.open_beneath(fd, rel)
        os.chown(tmp_path / "d" / "f", OTHER_UID, OTHER_UID)
        with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}"):
            private_dirs.open_beneath(fd, "d/f", owner=os.geteuid())
        with pytest.raises(FileNotFoundError):
            private_dirs.open_beneath(fd, "d/none")
    finally:
        os.close(fd)


# --- store-run staging (N1) ---------------------------------------------------------------------


@pytest.fixture
def host_tmp(tmp_path, monkeypatch):
    """$TMPDIR for this test: the host-local location that staging goes under."""
    where = tmp_path / "tmp"
    where.mkdir()
    where.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(where))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return where


def _store(experiment: str = "exp") -> Store:
    return Store(fsspec.filesystem("memory"), f"/bucket-{uuid.uuid4().hex}/{experiment}", rank=0,
                 attempt=0, first_round=1, committed=[], experiment_name=experiment)


def _checkpoint(tmp_path: Path, data: bytes) -> str:
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "weights.bin").write_bytes(data)
    return str(src)


@pytest.mark.parametrize("squat", ["another user's", "open to all"])
def test_staging_under_a_user_directory_another_user_made_is_refused(tmp_path, host_tmp, squat):
    """The review's N1: another local user makes /tmp/jaxtrain-<victim>/staging first (under
    either name the user's directory has had: by uid, by user name), to read every staged part
    and swap it before the upload. Nothing is staged there."""
    for name in {f"jaxtrain-{os.geteuid()}", f"jaxtrain-{getpass.getuser()}"}:
        for level in (host_tmp / name, host_tmp / name / "staging"):
            level.mkdir()
            level.chmod(0o777)
            if squat == "another user's":
                os.chown(level, OTHER_UID, OTHER_UID)
    store = _store()
    src = _checkpoint(tmp_path, b"GOOD-WEIGHTS")
    with pytest.raises(PermissionError, match="is not a private directory of this user's"):
        _core.stage_directory(src, store.make_staging(store.staging(1)), durable=False)
    assert not list(host_tmp.rglob("weights.bin"))


def test_staged_parts_are_private_and_carry_the_staged_sha256(tmp_path, host_tmp):
    store = _store()
    staging = store.make_staging(store.staging(1))
    for level in Path(staging).relative_to(host_tmp).parents:
        if str(level) != ".":
            assert _mode(host_tmp / level) == 0o700
    assert _mode(Path(staging)) == 0o700
    [entry] = _core.stage_directory(_checkpoint(tmp_path, b"GOOD-WEIGHTS"), staging,
                                    durable=False, sha256=True)
    assert entry["sha256"] == hashlib.sha256(b"GOOD-WEIGHTS").hexdigest()
    description = {"staging": staging, "dir_name": "checkpoint_000001", "files": [entry]}
    stager.upload(store, description, 1, None)
    assert store.fs.cat_file(f"{store.root}/checkpoint_000001/weights.bin") == b"GOOD-WEIGHTS"
    assert not Path(staging).exists()


class _Client:
    def __init__(self) -> None:
        self.reports: list = []

    def report_checkpoint(self, round_, description, text):
        self.reports.append(json.loads(description))


def test_a_part_in_memory_is_uploaded_from_memory_without_staging(tmp_path, host_tmp,
                                                                  monkeypatch):
    """The snapshot report(checkpoint=) took is described and uploaded from memory: nothing is
    written under $TMPDIR, and each file's SHA-256 is hashlib's. A file of several parts is
    streamed in parts."""
    from jaxtrain.worker import checkpoint_store

    monkeypatch.setattr(checkpoint_store, "_PART", 4096)
    src = _checkpoint(tmp_path, b"GOOD-WEIGHTS")
    big = os.urandom(3 * 4096 + 5)
    Path(src, "sub").mkdir()
    Path(src, "sub", "big.bin").write_bytes(big)
    store = _store()
    client = _Client()
    s = stager.Stager(client, 0, pytest.fail, store=store)
    s.checkpoint(1, "{}", _core.snapshot_directory(src, 1 << 20),
                 {"staging": store.staging(1), "dir_name": "checkpoint_000001"})
    s.close()
    [description] = client.reports
    assert description["store"] and "staging" not in description
    sha256 = {f["path"]: f["sha256"] for f in description["files"]}
    assert sha256 == {"weights.bin": hashlib.sha256(b"GOOD-WEIGHTS").hexdigest(),
                      "sub/big.bin": hashlib.sha256(big).hexdigest()}
    assert store.fs.cat_file(f"{store.root}/checkpoint_000001/weights.bin") == b"GOOD-WEIGHTS"
    assert store.fs.cat_file(f"{store.root}/checkpoint_000001/sub/big.bin") == big
    assert not list(host_tmp.iterdir())  # no staging directory, not even its parents


def test_a_part_changed_after_it_was_staged_is_not_vouched_for(tmp_path, host_tmp):
    """The review's N1 swap: the bytes at the staging path change between staging and upload.
    The SHA-256 is the staged one, and the upload refuses bytes that do not match it, so the
    manifest never vouches for the changed part."""
    store = _store()
    staging = store.make_staging(store.staging(1))
    snapshot = _core.snapshot_directory(_checkpoint(tmp_path, b"GOOD-WEIGHTS"), 1 << 20)
    files = snapshot.write(staging, sha256=True)
    staged = hashlib.sha256(b"GOOD-WEIGHTS").hexdigest()
    assert files[0]["sha256"] == staged
    Path(staging, "weights.bin").write_bytes(b"EVILEVILEVIL")  # same size
    description = {"staging": staging, "dir_name": "checkpoint_000001", "files": files}
    with pytest.raises(StoreError, match="not the one staged"):
        stager.upload(store, description, 1, None)
    assert files[0]["sha256"] == staged

