"""Builds the test cluster's images as OCI archives that `ctr images import` takes (no registry).

    python image.py pause PAUSE_BINARY OUT.tar
    python image.py worker VENV OUT.tar CACHE_DIR

The worker image is what a user's training image is: a Python with jax and jaxtrain installed. It
is made of this machine's files, in two layers: the interpreter with the third-party packages of
VENV (cached in CACHE_DIR, keyed by their contents' listing, so it is built once), and jaxtrain
itself (rebuilt each time: it changes with every build). Layers are written deterministically, so
containerd unpacks an unchanged layer only once.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

# Packages of the development environment a training image does not need (s3fs and its botocore
# stay: pods write checkpoints to object storage themselves).
_LEFT_OUT = {"pyarrow", "moto", "cfnlint", "sympy", "networkx", "boto3", "s3transfer", "ruff",
             "pytest", "_pytest", "scikit_build_core", "nanobind",
             "pip", "setuptools", "pandas", "jaxtrain", "cryptography", "mpmath", "werkzeug",
             "flask", "docker", "aws_xray_sdk", "openapi_spec_validator", "jsonschema",
             "jsonschema_specifications", "joserfc", "py_partiql_parser", "graphql", "antlr4",
             "pyparsing", "regex", "jsonpath_ng", "ply"}


# Changes whenever what goes into the base layer changes, so that a cached one is not reused.
_FORMAT = 2


class _Layer:
    """A deterministic layer tar written to a file: sorted entries, root-owned, mtime 0."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)
        self._dirs: set[str] = set()

    def _parents(self, arc: str) -> None:
        parts = arc.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self._dirs:
                self._dirs.add(d)
                ti = tarfile.TarInfo(d)
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 0
                self._tar.addfile(ti)

    def add_tree(self, src: str, arc: str, skip=lambda rel: False) -> None:
        for dirpath, dirnames, filenames in os.walk(src):
            rel_dir = os.path.relpath(dirpath, src)
            dirnames[:] = sorted(d for d in dirnames
                                 if not skip(os.path.normpath(os.path.join(rel_dir, d))))
            for name in sorted(filenames):
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if not skip(rel):
                    self.add_file(os.path.join(dirpath, name), f"{arc}/{rel}")

    def add_file(self, src: str, arc: str) -> None:
        arc = arc.lstrip("/")
        self._parents(arc)
        ti = self._tar.gettarinfo(src, arc)
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = 0
        if ti.isreg():
            with open(src, "rb") as f:
                self._tar.addfile(ti, f)
        else:
            self._tar.addfile(ti)

    def add_link(self, arc: str, target: str) -> None:
        arc = arc.lstrip("/")
        self._parents(arc)
        ti = tarfile.TarInfo(arc)
        ti.type, ti.linkname, ti.mtime, ti.mode = tarfile.SYMTYPE, target, 0, 0o777
        self._tar.addfile(ti)

    def add_bytes(self, arc: str, data: bytes, mode: int = 0o644) -> None:
        arc = arc.lstrip("/")
        self._parents(arc)
        ti = tarfile.TarInfo(arc)
        ti.size, ti.mode, ti.mtime = len(data), mode, 0
        self._tar.addfile(ti, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def write_image(out: str, name: str, layers: list[str], env: list[str],
                entrypoint: list[str] | None) -> None:
    diff_ids = [_digest(p) for p in layers]
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": env, "Entrypoint": entrypoint, "WorkingDir": "/"},
              "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    config_data = json.dumps(config, sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(config_data).hexdigest()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": config_digest, "size": len(config_data)},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d,
                            "size": os.path.getsize(p)}
                           for d, p in zip(diff_ids, layers, strict=True)]}
    manifest_data = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest_data).hexdigest()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
        "size": len(manifest_data), "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}]}
    with tarfile.open(out + ".tmp", "w") as t:
        def add(arc: str, data: bytes) -> None:
            ti = tarfile.TarInfo(arc)
            ti.size, ti.mtime = len(data), 0
            t.addfile(ti, io.BytesIO(data))

        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", json.dumps(index).encode())
        add(f"blobs/sha256/{config_digest[7:]}", config_data)
        add(f"blobs/sha256/{manifest_digest[7:]}", manifest_data)
        for d, p in zip(diff_ids, layers, strict=True):
            t.add(p, f"blobs/sha256/{d[7:]}")
    os.replace(out + ".tmp", out)


def _libraries(paths: list[str]) -> set[str]:
    """The shared libraries (outside the given trees) that these binaries load."""
    found: set[str] = set()
    for p in paths:
        out = subprocess.run(["ldd", p], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split("=>")
            lib = (parts[1] if len(parts) > 1 else parts[0]).split("(")[0].strip()
            if lib.startswith("/"):
                found.add(lib)
    return found


def pause_image(binary: str, out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        layer = _Layer(os.path.join(tmp, "layer.tar"))
        layer.add_file(binary, "pause")
        layer.close()
        write_image(out, "registry.k8s.io/pause:3.10", [layer.path], [], ["/pause"])


def worker_image(venv: str, out: str, cache: str) -> None:
    py = os.path.join(venv, "bin", "python")
    info = json.loads(subprocess.check_output([py, "-c", (
        "import json, sys, sysconfig; print(json.dumps({'prefix': sys.base_prefix, "
        "'site': sysconfig.get_paths()['purelib'], 'version': '%d.%d' % sys.version_info[:2]}))"
    )]))
    prefix, site, version = info["prefix"], info["site"], info["version"]
    target_site = f"{prefix}/lib/python{version}/site-packages"

    def left_out(entry: str) -> bool:  # a top-level entry of site-packages
        name = entry.split("-")[0] if entry.endswith((".dist-info", ".egg-info")) else entry
        return name.lower() in _LEFT_OUT or entry == "__pycache__"

    listing = sorted(e for e in os.listdir(site) if not left_out(e))
    key = hashlib.sha256(json.dumps([_FORMAT, prefix, version, listing]).encode()).hexdigest()[:16]
    os.makedirs(cache, exist_ok=True)
    base_layer = os.path.join(cache, f"worker-base-{key}.tar")
    if not os.path.exists(base_layer):
        layer = _Layer(base_layer + ".tmp")
        busybox = shutil.which("busybox") or "/bin/busybox"
        layer.add_file(busybox, "bin/busybox")
        for applet in ("sh", "cat", "ls", "sleep", "env", "ps", "kill", "echo", "mkdir", "rm"):
            layer.add_link(f"bin/{applet}", "busybox")
        layer.add_bytes("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        layer.add_bytes("etc/group", b"root:x:0:\n")
        layer.add_bytes("tmp/.keep", b"")
        lib_dir = f"{prefix}/lib/python{version}"
        layer.add_tree(lib_dir, lib_dir.lstrip("/"),
                       skip=lambda rel: rel in ("test", "site-packages") or rel.startswith(
                           ("test/", "site-packages/", "idlelib", "tkinter", "ensurepip")))
        for name in os.listdir(f"{prefix}/lib"):
            if name.startswith("libpython"):
                layer.add_file(f"{prefix}/lib/{name}", f"{prefix}/lib/{name}")
        layer.add_file(f"{prefix}/bin/python{version}", f"{prefix}/bin/python{version}")
        layer.add_link(f"{prefix}/bin/python", f"python{version}")
        layer.add_link(f"{prefix}/bin/python3", f"python{version}")
        layer.add_tree(site, target_site.lstrip("/"),
                       skip=lambda rel: rel.split("/")[0] not in listing)
        binaries = [f"{prefix}/bin/python{version}"]
        for dirpath, _, filenames in (*os.walk(f"{lib_dir}/lib-dynload"), *os.walk(site)):
            binaries += [os.path.join(dirpath, f) for f in filenames if ".so" in f]
        for lib in sorted(_libraries(binaries)):
            if not lib.startswith((prefix, site)):
                layer.add_file(os.path.realpath(lib), lib)
        layer.close()
        os.replace(base_layer + ".tmp", base_layer)

    with tempfile.TemporaryDirectory() as tmp:
        top = _Layer(os.path.join(tmp, "jaxtrain.tar"))
        for entry in sorted(os.listdir(site)):
            if entry == "jaxtrain" or entry.lower().startswith("jaxtrain-"):
                top.add_tree(os.path.join(site, entry), f"{target_site}/{entry}".lstrip("/"),
                             skip=lambda rel: "__pycache__" in rel)
        jaxtrain_bin = f"{prefix}/bin/jaxtrain"
        top.add_bytes(jaxtrain_bin, (f"#!{prefix}/bin/python{version}\n"
                                     "import sys\nfrom jaxtrain.cli import main\n"
                                     "sys.exit(main())\n").encode(), 0o755)
        top.close()
        write_image(out, "docker.io/jaxtrain/worker:test", [base_layer, top.path],
                    [f"PATH={prefix}/bin:/usr/local/bin:/usr/bin:/bin"], None)


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "pause":
        pause_image(*rest)
    elif kind == "worker":
        worker_image(*rest)
    else:
        sys.exit(f"usage: {sys.argv[0]} pause BINARY OUT | worker VENV OUT CACHE")
