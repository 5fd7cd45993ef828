"""The runtime env's working_dir as shipped to hosts that do not share it
(python/jaxtrain/driver/runtime_env.py, worker/runtime_env.py): what is packed, the cap, links,
and what an archive may hold before a worker unpacks it. The end-to-end run on other hosts is in
tests/test_ssh.py."""

from __future__ import annotations

import io
import os
import re
import stat
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from jaxtrain import RunConfig
from jaxtrain.driver import options, runtime_env
from jaxtrain.worker import runtime_env as unpacking


@pytest.fixture(autouse=True)
def host_local(tmp_path, monkeypatch):
    """Each test's own host-local directory (TMPDIR), and the defaults of the settings."""
    tmp = tmp_path / "host-tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.delenv(options.WORKING_DIR_MAX_MIB_ENV, raising=False)
    monkeypatch.delenv(options.WORKING_DIR_GITIGNORE_ENV, raising=False)
    return tmp


def write(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def names(archive: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return tar.getnames()


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    write(root, {
        "train.py": "import model\n",
        "model/__init__.py": "VALUE = 1\n",
        "model/__pycache__/x.cpython-311.pyc": b"\0",
        ".git/HEAD": "ref: refs/heads/main\n",
        "data/big.bin": b"x" * 1000,
        "sub/data/also.bin": b"y",
        "weights.ckpt": b"w",
        "sub/keep.ckpt": b"k",
        "sub/deep/top.txt": "not the top one\n",
        "top.txt": "the top one\n",
        "notes/a.log": "a\n",
        "notes/.gitignore": "*.log\n",
        "run.sh": "#!/bin/sh\n",
    })
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    return root


def test_excludes_are_gitignore_patterns_and_git_and_pycache_never_go(tmp_path):
    root = project(tmp_path)

    packed = runtime_env.pack(str(root), ["data/", "*.ckpt", "!sub/keep.ckpt", "/top.txt"])

    assert names(packed.archive) == [
        "empty", "model", "model/__init__.py", "notes", "notes/.gitignore", "run.sh", "sub",
        "sub/deep", "sub/deep/top.txt", "sub/keep.ckpt", "train.py"]
    assert packed.files == 6
    assert packed.source == str(root)


def test_the_same_directory_packs_to_the_same_bytes(tmp_path):
    root = project(tmp_path)
    assert runtime_env.pack(str(root)).archive == runtime_env.pack(str(root)).archive


def test_gitignore_files_can_be_left_out_of_the_rules(tmp_path, monkeypatch):
    root = project(tmp_path)
    monkeypatch.setenv(options.WORKING_DIR_GITIGNORE_ENV, "0")
    assert "notes/a.log" in names(runtime_env.pack(str(root)).archive)
    monkeypatch.setenv(options.WORKING_DIR_GITIGNORE_ENV, "no")
    with pytest.raises(ValueError, match="JAXTRAIN_WORKING_DIR_GITIGNORE='no' is not allowed"):
        runtime_env.pack(str(root))


@pytest.mark.parametrize(("pattern", "path", "is_dir", "excluded"), [
    ("*.py", "a/b/c.py", False, True),
    ("a/*.py", "a/c.py", False, True),
    ("a/*.py", "x/a/c.py", False, False),  # a separator in the middle anchors it
    ("/c.py", "a/c.py", False, False),
    ("**/logs", "a/b/logs", True, True),
    ("a/**/z", "a/z", False, True),
    ("a/**/z", "a/b/c/z", False, True),
    ("a/**", "a/b", False, True),
    ("a/**", "a", True, False),
    ("build/", "build", False, False),  # directories only
    ("build/", "x/build", True, True),
    ("data?.[0-9]", "data1.7", False, True),
    ("data[!0-9]", "data1", False, False),
    (r"\#x", "#x", False, True),
    ("# a comment", "# a comment", False, False),
])
def test_a_pattern_matches_as_in_gitignore(pattern, path, is_dir, excluded):
    assert runtime_env._Rules("", [pattern]).excludes(path, is_dir) is excluded


def test_file_modes_are_kept_and_links_inside_stay_links(tmp_path):
    root = project(tmp_path)
    (root / "latest").symlink_to("model")
    (root / "model" / "same.py").symlink_to(root / "model" / "__init__.py")  # absolute, inside
    (root / "dangling").symlink_to("not-there-yet")

    path = Path(unpacking.unpack(runtime_env.pack(str(root)).archive))

    assert stat.S_IMODE((path / "run.sh").stat().st_mode) == 0o755
    assert os.readlink(path / "latest") == "model"
    assert os.readlink(path / "model" / "same.py") == "__init__.py"
    assert os.readlink(path / "dangling") == "not-there-yet"
    assert (path / "latest" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (path / "empty").is_dir()
    assert path.parent == Path(os.environ["TMPDIR"]) / f"jaxtrain-{os.geteuid()}" / "working_dir"
    assert len(path.name) == 64


@pytest.mark.parametrize("target", ["../outside", "/etc", "../model/../../outside"])
def test_a_link_that_leads_out_is_refused_naming_it(tmp_path, target):
    root = project(tmp_path)
    (tmp_path / "outside").mkdir()
    (root / "model" / "escape").symlink_to(target if target != "../outside" else "../../outside")

    with pytest.raises(ValueError) as e:
        runtime_env.pack(str(root))

    assert f"['working_dir']={str(root)!r} holds the symbolic link 'model/escape'" in str(e.value)
    assert "leads out of the directory" in str(e.value)
    assert "worker_runtime_env['excludes']" in str(e.value)


def test_a_link_out_that_is_excluded_is_not_refused(tmp_path):
    root = project(tmp_path)
    (root / "datasets").symlink_to("/etc")
    assert "datasets" not in names(runtime_env.pack(str(root), ["/datasets"]).archive)


def test_over_the_cap_is_refused_saying_what_is_big_and_what_to_do(tmp_path, monkeypatch):
    root = project(tmp_path)
    write(root, {"data/big.bin": os.urandom(3 * 2**20)})
    monkeypatch.setenv(options.WORKING_DIR_MAX_MIB_ENV, "1")

    with pytest.raises(ValueError) as e:
        runtime_env.pack(str(root))

    message = str(e.value)
    assert message.startswith(f"RunConfig.worker_runtime_env['working_dir']={str(root)!r} is too "
                              "big to ship to the workers' hosts: it packs to more than ")
    assert "over the cap of 1.0 MiB; its files take 3.0 MiB before packing, most in data/ " \
           "(3.0 MiB)" in message
    stopped_at = float(re.search(r"packs to more than ([\d.]+) MiB \(stopped there\)",
                                 message).group(1))
    assert stopped_at < 1.5  # stopped within the big file, not after packing it whole
    assert "worker_runtime_env['excludes']" in message
    assert "JAXTRAIN_WORKING_DIR_MAX_MIB=<MiB>" in message
    assert len(runtime_env.pack(str(root), ["data/"]).archive) < 2**20  # excluded, it fits


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5"])
def test_a_cap_that_is_not_a_whole_number_of_mib_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv(options.WORKING_DIR_MAX_MIB_ENV, value)
    with pytest.raises(ValueError, match=f"JAXTRAIN_WORKING_DIR_MAX_MIB={value!r} is not allowed;"
                                         " use a whole number of MiB above 0"):
        runtime_env.pack(str(project(tmp_path)))


def test_packing_that_takes_a_while_says_how_far_it_is(tmp_path, capsys):
    ticks = iter(range(0, 10_000, 2))

    runtime_env.pack(str(project(tmp_path)), clock=lambda: float(next(ticks)))

    err = capsys.readouterr().err
    assert f"jaxtrain: packing working_dir {str(tmp_path / 'project')!r} for the workers' " \
           "hosts: " in err
    assert f"jaxtrain: packed working_dir {str(tmp_path / 'project')!r}: 10 files, " in err


def test_quick_packing_says_nothing(tmp_path, capsys):
    runtime_env.pack(str(project(tmp_path)), clock=lambda: 0.0)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("runtime", "says"), [
    ({"working_dir": ".", "excludes": "data/"}, "['excludes']='data/' is not allowed; it must be "
                                                "a list of gitignore patterns"),
    ({"working_dir": ".", "excludes": ["ok", 3]}, "['excludes'][1]=3 is not allowed"),
    ({"excludes": ["data/"]}, "['excludes'] is given without a working_dir"),
    ({"conda": "env"}, "allowed: 'env_vars', 'working_dir', 'excludes'"),
])
def test_bad_excludes_are_refused_by_run_config(runtime, says):
    with pytest.raises(ValueError) as e:
        RunConfig(worker_runtime_env=runtime)
    assert says in str(e.value)


def test_run_config_keeps_the_excludes():
    run = RunConfig(worker_runtime_env={"working_dir": ".", "excludes": ("data/", "*.ckpt")})
    assert run.worker_runtime_env == {"working_dir": os.getcwd(), "excludes": ["data/", "*.ckpt"]}


# --- what a worker unpacks --------------------------------------------------------------------


def crafted(*members: tuple[str, str, str | bytes]) -> bytes:
    """A gzip'd tar of (name, kind, content or link target) members, as anyone could make."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = value.encode() if isinstance(value, str) else value
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "link": tarfile.SYMTYPE,
                         "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                         "device": tarfile.CHRTYPE}[kind]
            info.linkname = value if kind in ("link", "hardlink") else ""
            tar.addfile(info)
    return out.getvalue()


@pytest.mark.parametrize(("members", "says"), [
    ([("../x", "file", "pwned")], "member '../x' is not a plain relative path"),
    ([("/tmp/x", "file", "pwned")], "member '/tmp/x' is not a plain relative path"),
    ([("a/../../x", "file", "pwned")], "member 'a/../../x' is not a plain relative path"),
    ([("./x", "file", "pwned")], "member './x' is not a plain relative path"),
    ([("l", "link", "../..")], "member 'l' is a link that leads out of the directory"),
    ([("l", "link", "/etc/passwd")], "member 'l' is a link that leads out"),
    ([("h", "hardlink", "/etc/passwd")], "member 'h' is neither a file, a directory nor"),
    ([("f", "fifo", "")], "member 'f' is neither"),
    ([("d", "device", "")], "member 'd' is neither"),
    ([("l", "link", "sub"), ("l/x", "file", "through the link")],
     "member 'l/x' lies under 'l', which is not a directory"),
    ([("x", "file", "one"), ("x", "file", "two")], "holds 'x' twice"),
    # Each link stays inside as written; together they lead out: d/s is the root, d/x its parent.
    ([("d", "dir", ""), ("d/s", "link", ".."), ("d/x", "link", "s/..")],
     "link 'd/x' -> 's/..' leads out of the directory"),
])
def test_an_archive_that_would_write_outside_is_refused_and_leaves_nothing(tmp_path, members,
                                                                           says):
    archive = crafted(*members)
    before = sorted(p.name for p in tmp_path.iterdir())

    with pytest.raises(ValueError) as e:
        unpacking.unpack(archive)

    assert says in str(e.value)
    assert "the archive is refused, nothing of it is used" in str(e.value) or "leads out" in \
        str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    unpacked = Path(os.environ["TMPDIR"]) / f"jaxtrain-{os.geteuid()}" / "working_dir"
    assert list(unpacked.iterdir()) == []  # not even a partial copy


def test_ranks_of_one_host_unpacking_at_once_share_one_copy(tmp_path):
    archive = runtime_env.pack(str(project(tmp_path))).archive
    paths: list[str] = []
    go = threading.Barrier(4)

    def rank():
        go.wait()
        paths.append(unpacking.unpack(archive))

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(set(paths)) == 1 and len(paths) == 4
    assert os.listdir(Path(paths[0]).parent) == [Path(paths[0]).name]  # no leftovers
    assert (Path(paths[0]) / "model" / "__init__.py").read_text() == "VALUE = 1\n"


def test_a_partial_copy_left_by_a_killed_worker_is_removed_once_stale(tmp_path):
    root = Path(unpacking.unpack(crafted(("x", "file", "1")))).parent
    stale, fresh = root / ".0123456789abcdef-stale", root / ".0123456789abcdef-fresh"
    for partial in (stale, fresh):
        (partial / "sub").mkdir(parents=True)
    old = time.time() - unpacking.PARTIAL_STALE_S - 60
    os.utime(stale, (old, old))

    unpacking.unpack(crafted(("y", "file", "2")))

    assert not stale.exists() and fresh.exists()


def test_a_host_directory_that_others_may_write_to_is_refused(host_local):
    shared = host_local / f"jaxtrain-{os.geteuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="is not a private directory of this user.s"):
        unpacking.unpack(crafted(("x", "file", "1")))


def test_the_payload_carries_the_task_and_the_shipped_directory(tmp_path):
    packed = runtime_env.pack(str(project(tmp_path)))
    assert unpacking.unwrap(runtime_env.wrap(b"task", None)) == (b"task", None)
    assert unpacking.unwrap(runtime_env.wrap(b"task", packed)) == (
        b"task", {"archive": packed.archive, "source": packed.source})


def test_a_worker_enters_its_copy_in_place_of_the_drivers_directory(tmp_path):
    root = project(tmp_path)
    write(root, {"src/pkg_in_src/__init__.py": "WHERE = __file__\n"})
    shipped = {"archive": runtime_env.pack(str(root)).archive, "source": str(root)}
    code = (
        "import os, sys\n"
        "from jaxtrain.worker import runtime_env\n"
        f"path = runtime_env.enter({shipped!r})\n"
        "import model, pkg_in_src\n"
        "print(path, os.getcwd(), model.__file__, pkg_in_src.WHERE, sys.path[0],\n"
        "      os.environ['PYTHONPATH'].split(os.pathsep)[:2], sep='\\n')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}

    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()

    path = out[0]
    assert out[1:] == [path, f"{path}/model/__init__.py", f"{path}/src/pkg_in_src/__init__.py",
                       path, str([path, f"{path}/src"])]
    assert not path.startswith(str(root))
