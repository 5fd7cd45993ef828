"""JAX's persistent compilation cache with real JAX workers: a restarted group loads the programs
its first attempt compiled; it is turned off, or left to the user, on request."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from jaxtrain import FailureConfig, JaxTrainer, RunConfig, ScalingConfig

# JAX's own default writes only programs that took 1 s to compile; jaxtrain's cache writes every
# program (the small step below too) unless the user set this for the workers.
_THRESHOLD = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def _step_once(config):
    """One data-parallel step over every rank's device; notes, per rank and attempt, the cache
    directory JAX uses, the entries there before the step, the cache hits of the step and the
    compilations it ran itself. Each rank's rows are its rank + 1; with `by_rank` the step adds
    the rank (a constant of it) to the loss, so that each rank's program differs. Rank 1 fails
    after attempt 0's step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import monitoring
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain import get_context, report

    ctx = get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    hits, compiled = [], []
    monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event.endswith("/cache_hits") else None)
    from jax._src import compiler  # XLA's compilation itself, which a cache hit or a program
    compile_and_load = compiler.backend_compile_and_load  # loaded from rank 0 does not call

    def counted(*args, **kwargs):
        compiled.append(args)
        return compile_and_load(*args, **kwargs)

    compiler.backend_compile_and_load = counted
    cache_dir = jax.config.jax_compilation_cache_dir
    before = sorted(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else []

    sharding = NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), P("data"))
    x = jax.make_array_from_process_local_data(sharding, np.full((8, 16), rank + 1, np.float32))
    hits.clear()  # only the step's own compilation counts
    compiled.clear()
    own = rank if config.get("by_rank") else 0
    step = jax.jit(lambda x: jnp.tanh(2 * x).sum() + own, in_shardings=sharding)
    loss = float(step(x))
    note = Path(config["out"], f"a{attempt}-r{rank}.json")
    Path(f"{note}.tmp").write_text(json.dumps(
        {"cache_dir": cache_dir, "entries_before": before, "step_hits": len(hits),
         "step_compiled": len(compiled), "loss": loss}))
    os.replace(f"{note}.tmp", note)  # whole or absent, as a killed rank leaves it
    if attempt == 0 and rank == 1 and config.get("fail"):
        # Rank 0's note is written after its step, which may end after this rank's; the
        # failure kills the group, so it waits for the note (the step itself is a collective,
        # so what rank 0 compiled and cached is on disk by then).
        note, deadline = Path(config["out"], "a0-r0.json"), time.monotonic() + 60
        while not note.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("injected failure after the first step")
    report({"loss": loss})


def _fit(storage, tmp_path, name, *, fail=False, env_vars=None, by_rank=False):
    return JaxTrainer(
        _step_once,
        train_loop_config={"out": str(tmp_path), "fail": fail, "by_rank": by_rank},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=name, storage_path=storage, failure_config=FailureConfig(max_failures=1),
            worker_runtime_env={"env_vars": env_vars or {}}),
    ).fit()


def _notes(tmp_path, attempt, rank):
    return json.loads(Path(tmp_path, f"a{attempt}-r{rank}.json").read_text())


def test_a_restarted_group_loads_what_the_first_attempt_compiled(storage, tmp_path):
    result = _fit(storage, tmp_path, "restarted", fail=True)
    cache = Path(result.path, "compilation-cache")
    run = json.loads(Path(result.path, "run.json").read_text())
    assert [a["status"] for a in run["attempts"]] == ["ERRORED", "FINISHED"]
    for rank in (0, 1):
        first, second = _notes(tmp_path, 0, rank), _notes(tmp_path, 1, rank)
        assert first["cache_dir"] == second["cache_dir"] == str(cache)
        assert first["step_hits"] == 0, f"rank {rank}: attempt 0 started with a warm cache"
        # What attempt 0 wrote is there when attempt 1 starts, and its step is loaded from it,
        # on every rank, without writing a new entry for it.
        assert any(e.startswith("jit__lambda") for e in second["entries_before"]), second
        assert second["step_hits"] >= 1, f"rank {rank} compiled the step again: {second}"
    assert sorted(os.listdir(cache)) == _notes(tmp_path, 1, 1)["entries_before"]


def _step_entries(result):
    """The cache's entries for the step (jit of a lambda)."""
    return [e for e in os.listdir(Path(result.path, "compilation-cache"))
            if e.startswith("jit__lambda")]


# The step's loss on 2 ranks whose 8 x 16 rows are 1 and 2.
_LOSS = 8 * 16 * float(np.tanh(2.0) + np.tanh(4.0))


def test_a_cpu_group_on_one_host_compiles_each_program_once(storage, tmp_path):
    # Rank 0 compiles the step and rank 1 loads its executable instead of compiling the same
    # program on the same cores; both compute the loss of every rank's rows, and the cache holds
    # one entry for the step, which a restarted group loads on every rank.
    result = _fit(storage, tmp_path, "shared", fail=True)
    first = [_notes(tmp_path, 0, rank) for rank in (0, 1)]
    assert [n["step_compiled"] for n in first] == [1, 0], first
    steps = _step_entries(result)
    assert len(steps) == 1, steps
    for rank in (0, 1):
        again = _notes(tmp_path, 1, rank)
        assert again["step_hits"] >= 1 and again["step_compiled"] == 0, again
        assert first[rank]["loss"] == again["loss"] == pytest.approx(_LOSS, rel=1e-6)


def test_jax_share_binary_between_hosts_false_turns_the_sharing_off(storage, tmp_path):
    _fit(storage, tmp_path, "unshared", env_vars={"JAX_SHARE_BINARY_BETWEEN_HOSTS": "false"})
    assert [_notes(tmp_path, 0, rank)["step_compiled"] for rank in (0, 1)] == [1, 1]


@pytest.mark.parametrize("version", [(0, 12, 1), (0, 13, 0), (0, 5, 3)])
def test_a_jaxlib_whose_loaded_programs_are_not_checked_shares_nothing(version, monkeypatch):
    # On jaxlib 0.12.1 a CPU program loaded from rank 0 hangs in its first collective: a version
    # outside the checked ones keeps JAX's compilation on every rank, untouched.
    import jax
    from jax._src import cache_key, compiler, lib

    from jaxtrain.worker import compilation_cache

    monkeypatch.setattr(lib, "version", version)
    share, hash_config = compiler._compile_and_share_module, cache_key._hash_accelerator_config
    assert compilation_cache.share_cpu_programs(jax, b"secret") is False
    assert compiler._compile_and_share_module is share
    assert cache_key._hash_accelerator_config is hash_config
    assert not jax.config.jax_share_binary_between_hosts


class _KeyValueStore:
    """JAX's coordination service's key-value store as program sharing uses it, in memory; and,
    as the real one, open to whoever reaches it."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def key_value_set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        return self.values[key].decode()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        return self.values[key]


class _Backend:
    """A CPU backend whose executables are bytes: what rank 0 compiled, or what a rank loaded."""

    platform = "cpu"

    def __init__(self) -> None:
        self.loaded: list[bytes] = []

    def serialize_executable(self, executable) -> bytes:
        return executable

    def deserialize_executable(self, serialized, devices, options):
        self.loaded.append(bytes(serialized))
        return ("loaded", bytes(serialized))


def test_a_shared_program_is_loaded_only_with_the_runs_mac(monkeypatch):
    # JAX's key-value store is unauthenticated: anyone who reaches the coordinator can put an
    # executable under a program's key. A rank loads a shared executable only when it carries a
    # MAC under the run's secret; any other it refuses, and compiles the program itself.
    import jax
    from jax._src import cache_key, compiler, distributed
    from jax._src import compilation_cache as jax_cache

    from jaxtrain.worker import compilation_cache

    compiled = []

    def compile_here(backend, computation, executable_devices, compile_options, host_callbacks,
                     module_name, cache_key):
        compiled.append(cache_key)
        return b"compiled " + cache_key.encode()

    for name in ("_compile_and_share_module", "_compile_and_write_cache"):
        monkeypatch.setattr(compiler, name, getattr(compiler, name))
    monkeypatch.setattr(compiler._compile_and_share_module, "modules_cache", {})
    monkeypatch.setattr(compiler, "_compile_and_write_cache", compile_here)
    monkeypatch.setattr(cache_key, "_hash_accelerator_config",
                        cache_key._hash_accelerator_config)
    sharing = jax.config.jax_share_binary_between_hosts
    try:
        assert compilation_cache.share_cpu_programs(jax, b"the run's secret")
        share = compiler._compile_and_share_module
        store, backend = _KeyValueStore(), _Backend()

        def run_as(process_id: int, key: str):
            monkeypatch.setattr(distributed.global_state, "process_id", process_id)
            share.modules_cache.clear()
            return share(backend, None, None, None, [], store, "jit_step", key, 0)

        # Rank 0 compiles and shares; rank 1 loads what rank 0 compiled.
        assert run_as(0, "step") == b"compiled step"
        assert run_as(1, "step") == ("loaded", b"compiled step")
        # A program planted by someone else (without the MAC, or with another run's) is not
        # loaded: rank 1 compiles it itself.
        store.key_value_set("jaxtrain/compiling/evil", "1")
        store.key_value_set_bytes("evil", jax_cache.compress_executable(b"planted"))
        assert run_as(1, "evil") == b"compiled evil"
        other_run = compilation_cache.SharedPrograms(store, b"another run's secret")
        other_run.key_value_set_bytes("evil", jax_cache.compress_executable(b"planted"))
        assert run_as(1, "evil") == b"compiled evil"
        assert backend.loaded == [b"compiled step"]
        assert compiled == ["step", "evil", "evil"]
    finally:
        jax.config.update("jax_share_binary_between_hosts", sharing)


_PUT_ENTRY = """
import resource, signal, sys
from jax._src import lru_cache
from jaxtrain.worker import compilation_cache
directory, whole, limit, key = sys.argv[1], sys.argv[2] == "whole", int(sys.argv[3]), sys.argv[4]
if whole:
    compilation_cache._write_entries_whole()
if limit:  # Python ignores SIGXFSZ; a process that does not is killed by it
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
lru_cache.LRUCache(directory, max_size=-1).put(key, b"x" * (4 << 20))
"""


def _put_entry(directory: Path, whole: bool, limit: int = 0, key: str = "step") -> int:
    """Writes a 4 MiB entry in a new process, which the kernel kills (SIGXFSZ) once it has
    written `limit` bytes to one file: a rank killed while writing; its exit status."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _PUT_ENTRY, str(directory),
                           "whole" if whole else "jax", str(limit), key], timeout=120).returncode


def test_a_cache_entry_is_written_whole_or_not_at_all(tmp_path):
    import signal

    from jax._src import lru_cache

    # JAX's own writer: a rank killed half-way leaves a truncated entry, which a later attempt
    # reads (and fails to load) and which is never written again.
    jax_dir, dir_ = tmp_path / "jax", tmp_path / "jaxtrain"
    assert _put_entry(jax_dir, whole=False, limit=1 << 20) == -signal.SIGXFSZ
    assert len(lru_cache.LRUCache(str(jax_dir), max_size=-1).get("step")) == 1 << 20
    # jaxtrain's: no entry at all, and the next attempt writes it whole.
    assert _put_entry(dir_, whole=True, limit=1 << 20) == -signal.SIGXFSZ
    assert lru_cache.LRUCache(str(dir_), max_size=-1).get("step") is None
    assert _put_entry(dir_, whole=True) == 0
    assert lru_cache.LRUCache(str(dir_), max_size=-1).get("step") == b"x" * (4 << 20)
    # What the killed write left is a hidden partial file, which nothing reads.
    left = sorted(p.name for p in dir_.iterdir())
    assert left[1:] == ["step-cache"] and left[0].endswith(".partial"), left
    # JAX's key is the program's whole name and its hash: an entry whose file name is near the
    # longest a file system allows (255) is written as JAX would write it.
    key = "jit_" + "g" * 170 + "-" + "0123456789abcdef" * 4
    assert _put_entry(dir_, whole=True, key=key) == 0
    assert lru_cache.LRUCache(str(dir_), max_size=-1).get(key) == b"x" * (4 << 20)
    assert sorted(p.name for p in dir_.iterdir()) == sorted([*left, f"{key}-cache"])


def test_an_entry_torn_by_a_host_that_went_down_is_written_again(tmp_path):
    # Entries are not synced: a host that goes down may leave one empty under its name. JAX fails
    # to load it, compiles the program and asks to write it again, which then replaces it.
    from jax._src import lru_cache

    dir_ = tmp_path / "cache"
    dir_.mkdir()
    (dir_ / "step-cache").write_bytes(b"")
    assert _put_entry(dir_, whole=True) == 0
    assert lru_cache.LRUCache(str(dir_), max_size=-1).get("step") == b"x" * (4 << 20)
    assert sorted(p.name for p in dir_.iterdir()) == ["step-cache"]


def test_a_program_that_differs_by_rank_is_compiled_by_each_rank(storage, tmp_path):
    # Rank 1 waits a bounded time for a program rank 0 never compiles (rank 0's differs), then
    # compiles its own; a restarted group loads each rank's own entry.
    result = _fit(storage, tmp_path, "by-rank", fail=True, by_rank=True)
    for rank in (0, 1):
        first, again = _notes(tmp_path, 0, rank), _notes(tmp_path, 1, rank)
        assert first["step_compiled"] == 1 and first["loss"] == pytest.approx(_LOSS + rank)
        assert again["step_compiled"] == 0 and again["step_hits"] >= 1, again
    steps = _step_entries(result)
    assert len(steps) == 2, steps


def test_a_threshold_the_user_set_is_kept(storage, tmp_path):
    # The step compiles in far less than 1000 s: with the user's threshold it is never written,
    # and the restarted group compiles it again.
    result = _fit(storage, tmp_path, "threshold", fail=True, env_vars={_THRESHOLD: "1000"})
    cache = Path(result.path, "compilation-cache")
    assert not any(e.startswith("jit__lambda") for e in os.listdir(cache)), os.listdir(cache)
    for rank in (0, 1):
        assert _notes(tmp_path, 1, rank)["step_hits"] == 0


def test_jaxtrain_compilation_cache_0_turns_the_cache_off(storage, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_COMPILATION_CACHE", "0")
    result = _fit(storage, tmp_path, "off")
    assert not Path(result.path, "compilation-cache").exists()
    for rank in (0, 1):
        assert _notes(tmp_path, 0, rank)["cache_dir"] is None


def test_the_users_cache_directory_is_kept(storage, tmp_path):
    own = tmp_path / "own-cache"
    # A cache of the user's own is left as JAX has it: its 1 s threshold too, which the user
    # lowers here so that the small step is written.
    result = _fit(storage, tmp_path, "own",
                  env_vars={"JAX_COMPILATION_CACHE_DIR": str(own), _THRESHOLD: "0"})
    assert not Path(result.path, "compilation-cache").exists()
    for rank in (0, 1):
        assert _notes(tmp_path, 0, rank)["cache_dir"] == str(own)
    assert any(e.startswith("jit__lambda") for e in os.listdir(own))


@pytest.mark.parametrize("value", ["yes", "2", "off", " 1"])
def test_a_bad_jaxtrain_compilation_cache_is_refused_by_name(value, storage, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv("JAXTRAIN_COMPILATION_CACHE", value)
    with pytest.raises(ValueError, match=rf"JAXTRAIN_COMPILATION_CACHE='{value}' is not "
                                         r"allowed; use 1 \(the default.*or 0"):
        _fit(storage, tmp_path, "bad")
    assert not os.listdir(storage)  # refused before the run directory was made

