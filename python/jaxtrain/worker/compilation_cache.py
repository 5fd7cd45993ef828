"""JAX's persistent compilation cache in a worker: where it is, which ranks write it, whole entries
only, and one compilation per program for a CPU group on one host (docs/compilation-cache.md).

``set_up`` is called once, after ``import jax`` and before anything is compiled. What it changes
in JAX is internal to JAX, so each change first checks that the jax version's functions are the
ones expected and otherwise leaves JAX as it is: a slower restart, never a wrong program.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import os
import secrets
import sys

COMPILATION_CACHE_DIR = "compilation-cache"


def set_up(jax, run_dir: str, *, platform: str, rank: int, world_size: int, local_rank: int,
           local_world_size: int, secret: bytes) -> str | None:
    """Turns the cache on for this worker (see _use); with several processes, lets every rank
    write its own entries on CPU and in store runs (cache_every_cpu_rank), and shares each
    program's compilation when every CPU rank reads one cache on one host (share_cpu_programs,
    its executables MACed under the run's `secret`). The cache directory, or None when the cache
    is left off or to the user."""
    from jaxtrain.worker.checkpoint_store import STORE_ENV

    store_run = os.environ.get(STORE_ENV) == "1"
    path = _use(jax, run_dir, store_run)
    if path is None:
        return None
    _write_entries_whole()
    if world_size > 1:
        if platform == "cpu" and local_world_size == world_size and not store_run:
            share_cpu_programs(jax, secret)
        if platform == "cpu" or store_run:
            cache_every_cpu_rank(rank, local_rank, every_host=store_run)
    return path


def _use(jax, run_dir: str, store_run: bool) -> str | None:
    """Points JAX's persistent compilation cache at ``<run_dir>/compilation-cache``, shared by
    every rank and attempt of the run, so that a restarted group loads its programs instead of
    compiling them again; the directory it set, or None.

    Called before anything is compiled. Left alone: JAXTRAIN_COMPILATION_CACHE=0 (the driver
    passes it on, checked), and a cache directory the user chose (JAX_COMPILATION_CACHE_DIR, or
    jax_compilation_cache_dir set some other way before the training function). Every program is
    written, however quick its compilation (jax_persistent_cache_min_compile_time_secs 0 unless the
    workers' environment sets JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS), by process 0 only, so
    that other hosts hit the cache only where the run directory is shared (as Slurm and Kubernetes
    runs across hosts already require). JAX caches the CPU backend's programs too, but see
    cache_every_cpu_rank and share_cpu_programs."""
    if os.environ.get("JAXTRAIN_COMPILATION_CACHE", "1") == "0":
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return None
    path = os.path.join(run_dir, COMPILATION_CACHE_DIR)
    if store_run:  # the run directory is not on this host: its own cache
        from jaxtrain.worker.checkpoint_store import host_cache_dir

        path = host_cache_dir(COMPILATION_CACHE_DIR, os.path.basename(run_dir))
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however quick to compile (JAX's threshold is 1 s), so that a restarted group
    # compiles nothing: the model's initialisation and the small programs around the step too.
    # A threshold the user set for the workers is kept.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path


def cache_every_cpu_rank(rank: int, local_rank: int, every_host: bool = False) -> None:
    """Lets every rank of a multi-process CPU run write its own cache entries; with `every_host`
    (a store run, whose cache is per host) also the first rank of each host on other platforms,
    whose entries the other hosts' caches would otherwise never get.

    On CPU, JAX's cache key includes a fingerprint of the topology as this process sees it (which
    of the devices are local), so each rank's key for the same SPMD program differs, while JAX
    writes entries from process 0 only: without this, ranks 1..N-1 compile again after every
    restart and the group's first step waits for them (where share_cpu_programs makes the keys of
    programs that span the processes agree, this still keeps the programs of a rank's own devices,
    and those a rank compiled itself). JAX has no setting for this, so its
    internal writer is wrapped, for the CPU backend only; where a jax version's writer is not the
    one expected, the cache serves rank 0 alone (said once on stderr)."""
    try:
        from jax._src import compilation_cache, compiler, config, distributed
        write = compiler._cache_write
        put = compilation_cache.put_executable_and_time
        min_compile_time = config.persistent_cache_min_compile_time_secs
        params = list(inspect.signature(write).parameters)
        # jax 0.11 dropped the writer's host_callbacks (callbacks are serialised now).
        with_callbacks = params[5:] == ["host_callbacks"]
        expected = (params[:5] == [
            "cache_key", "compile_time_secs", "module_name", "backend", "executable"]
            and len(params) == 5 + with_callbacks
            and list(inspect.signature(put).parameters) == [
            "cache_key", "module_name", "executable", "backend", "compile_time"])
    except (ImportError, AttributeError, TypeError, ValueError):
        expected = False
    if not expected:
        if rank == 1:
            sys.stderr.write("jaxtrain worker: this jax's compilation cache is written by rank 0 "
                             "only; on CPU the other ranks compile again after a restart\n")
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                    *host_callbacks):
        ours = backend.platform == "cpu" or (every_host and local_rank == 0)
        if (distributed.global_state.process_id == 0 or not ours
                or any(host_callbacks) or compile_time_secs < min_compile_time.value):
            return write(cache_key, compile_time_secs, module_name, backend, executable,
                         *host_callbacks)
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # as JAX does: a cache that cannot be written is not fatal
            import warnings

            warnings.warn(f"Error writing persistent compilation cache entry for "
                          f"'{module_name}': {type(e).__name__}: {e}", stacklevel=2)

    compiler._cache_write = cache_write


# How long a rank other than 0 waits for rank 0 to say it compiles a program that spans the
# processes before compiling the program itself (a program that differs by rank, or one rank 0
# found in its cache, is never sent).
SHARE_ANNOUNCE_WAIT_S = 10

# The jaxlib versions whose CPU executables, compiled by rank 0, run on the other ranks of the
# group: checked with a psum across processes on 0.6.2, 0.10.2, 0.11.2 and 0.12.0. On 0.12.1 a
# loaded program hangs in its first collective on every rank, so newer versions compile on every
# rank until checked: widen the range only after running scripts/test-wheel.sh's psum script on
# the new version with the range widened (jax 0.5, which 0.6.2's range leaves out, never shares).
SHARE_JAXLIB_VERIFIED = ((0, 6, 0), (0, 12, 0))


def share_cpu_programs(jax, secret: bytes) -> bool:
    """One compilation per program for a CPU group on one host: rank 0 compiles each
    multi-process program and the other ranks load its executable (JAX's
    jax_share_binary_between_hosts, through the coordination service's key-value store) instead of
    compiling the same program at once on the same cores. True when it is set up.

    JAX's key-value store is unauthenticated, and any local user can reach the coordinator's
    port: an executable is therefore shared with a MAC under the run's `secret`
    (SharedPrograms), and a rank loads only one whose MAC checks; any other it refuses, says so
    on stderr and compiles the program itself, as without sharing.

    JAX shares a program only between processes whose cache keys agree, and on CPU the key holds a
    fingerprint of the topology as each process sees it (which devices are its own), so ranks
    never agree; here a CPU program's key holds every device's id and process instead, and this
    machine's CPU model and features (an entry is never loaded by another kind of CPU). Other
    platforms keep JAX's key. A restarted group then finds one entry per program for every rank.

    JAX's share makes a rank that missed the cache wait (20 minutes) for the program from rank 0,
    which sends it only when it compiles that very program: not when rank 0 found it in its cache,
    and never for a program that differs by rank (a constant of the rank, a host callback on one
    rank only). So rank 0 first says which program it compiles, and a rank that hears nothing of
    its own program within SHARE_ANNOUNCE_WAIT_S compiles it itself, as without sharing. The
    caller sets this up only where every rank reads one cache directory on one host; not with a
    bounded cache (JAX_COMPILATION_CACHE_MAX_SIZE, whose entries rank 0's writes may evict between
    rank 0's read and another rank's), nor when the workers' environment turns
    JAX_SHARE_BINARY_BETWEEN_HOSTS off. Where the jaxlib is not one of SHARE_JAXLIB_VERIFIED, a
    jax version's internals are not the ones expected, or this machine's CPU cannot be named,
    nothing is changed (False)."""
    if os.environ.get("JAX_SHARE_BINARY_BETWEEN_HOSTS", "").strip().lower() in (
            "0", "false", "f", "n", "no", "off"):  # turned off by the user
        return False
    if getattr(jax.config, "jax_compilation_cache_max_size", -1) != -1:
        return False
    try:
        from jax._src import cache_key, compiler, config, distributed, lib
        low, high = SHARE_JAXLIB_VERIFIED
        if not low <= tuple(lib.version)[:3] <= high:
            return False
        hash_config = cache_key._hash_accelerator_config
        share = compiler._compile_and_share_module
        compile_here = compiler._compile_and_write_cache
        expected = (
            list(inspect.signature(hash_config).parameters) == ["hash_obj", "accelerators"]
            and list(inspect.signature(share).parameters) == [
                "backend", "computation", "executable_devices", "compile_options",
                "host_callbacks", "global_client", "module_name", "cache_key",
                "first_process_id"]
            and list(inspect.signature(compile_here).parameters) == [
                "backend", "computation", "executable_devices", "compile_options",
                "host_callbacks", "module_name", "cache_key"]
            and isinstance(getattr(share, "modules_cache", None), dict)
            and hasattr(config, "share_binary_between_hosts"))
    except (ImportError, AttributeError, TypeError, ValueError):
        expected = False
    machine = _cpu_model()
    if not expected or machine is None:
        return False

    def hash_devices(hash_obj, accelerators) -> None:
        devices = list(accelerators.flat)
        if not devices or any(d.platform != "cpu" for d in devices):
            return hash_config(hash_obj, accelerators)
        hash_obj.update(machine.encode())
        hash_obj.update(repr([(d.id, d.process_index) for d in devices]).encode())

    announced: set[str] = set()

    def share_or_compile(backend, computation, executable_devices, compile_options,
                         host_callbacks, global_client, module_name, cache_key,
                         first_process_id):
        started = f"jaxtrain/compiling/{cache_key}"
        if distributed.global_state.process_id == first_process_id:
            if started not in announced:  # once: the store refuses a key set twice
                announced.add(started)
                try:
                    global_client.key_value_set(started, "1")
                except Exception:  # unsaid, the others compile it themselves after their wait
                    pass
        else:
            try:
                global_client.blocking_key_value_get(started, SHARE_ANNOUNCE_WAIT_S * 1000)
            except Exception:  # not this program: compiled here, as without sharing
                return compile_here(backend, computation, executable_devices, compile_options,
                                    host_callbacks, module_name, cache_key)
        try:
            return share(backend, computation, executable_devices, compile_options,
                         host_callbacks, SharedPrograms(global_client, secret), module_name,
                         cache_key, first_process_id)
        except ForgedProgram as e:
            sys.stderr.write(f"jaxtrain worker: {e}; compiling it here\n")
            return compile_here(backend, computation, executable_devices, compile_options,
                                host_callbacks, module_name, cache_key)

    # JAX's function finds its in-process cache through its module's name for it, now this one.
    share_or_compile.modules_cache = share.modules_cache
    cache_key._hash_accelerator_config = hash_devices
    compiler._compile_and_share_module = share_or_compile
    jax.config.update("jax_share_binary_between_hosts", True)
    return True


class ForgedProgram(Exception):
    """An executable in the key-value store without a valid MAC under the run's secret."""


class SharedPrograms:
    """JAX's distributed client as its program sharing uses it (key_value_set_bytes by the
    compiling rank, blocking_key_value_get_bytes by the others), with every executable MACed:
    what is stored is the executable followed by HMAC-SHA-256(key, cache key | 0 | executable),
    the key derived from the run's secret for this use only. A value that is too short or whose
    MAC does not check raises ForgedProgram before anything of it is loaded."""

    _MAC_SIZE = 32

    def __init__(self, client, secret: bytes) -> None:
        self._client = client
        self._key = hmac.new(secret, b"jaxtrain-shared-program-key", hashlib.sha256).digest()

    def _mac(self, cache_key: str, executable: bytes) -> bytes:
        return hmac.new(self._key, cache_key.encode() + b"\0" + executable,
                        hashlib.sha256).digest()

    def key_value_set_bytes(self, cache_key: str, executable: bytes) -> None:
        self._client.key_value_set_bytes(cache_key,
                                         executable + self._mac(cache_key, executable))

    def blocking_key_value_get_bytes(self, cache_key: str, timeout_ms: int) -> bytes:
        value = bytes(self._client.blocking_key_value_get_bytes(cache_key, timeout_ms))
        executable, mac = value[:-self._MAC_SIZE], value[-self._MAC_SIZE:]
        if (len(value) < self._MAC_SIZE
                or not hmac.compare_digest(mac, self._mac(cache_key, executable))):
            raise ForgedProgram(f"the executable shared for program {cache_key} does not carry "
                                "the run's MAC (someone else wrote it into the coordinator's "
                                "key-value store)")
        return executable


def _cpu_model() -> str | None:
    """This machine's architecture, CPU model and feature flags (/proc/cpuinfo's first CPU), or
    None where they cannot be read."""
    import platform

    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    lines.append(line.strip())
                if not line.strip() and lines:  # the first CPU's block ended
                    break
    except OSError:
        return None
    return "\n".join([platform.machine(), *lines]) if lines else None


def _write_entries_whole() -> None:
    """Makes JAX write each cache entry whole or not at all: to a temporary file beside it, then
    renamed into place. JAX writes the entry's file in place, so a rank killed while writing (a
    failure, a preemption) leaves a truncated entry, which every later attempt fails to load,
    compiles again, and never replaces (an entry that exists is not written again); a rank that
    reads an entry another is writing would see part of it. A cache bounded by
    JAX_COMPILATION_CACHE_MAX_SIZE, whose writes JAX locks and counts, and one that is not a local
    directory keep JAX's own writer.

    The entry is not synced: on a group of CPU ranks, where every program is written however
    quick its compilation, a sync per entry made the first step ~1.5 s slower on two cores. A
    host that goes down may then leave an entry empty or torn under its name; JAX fails to load
    it and compiles the program, and the entry is written again then (JAX asks to write only
    what it did not load), so it heals at the next compilation instead of never."""
    try:
        from jax._src import lru_cache

        cache_class, suffix = lru_cache.LRUCache, lru_cache._CACHE_SUFFIX
        put = cache_class.put
        expected = (list(inspect.signature(put).parameters)[:2] == ["self", "key"]
                    and len(inspect.signature(put).parameters) == 3)
    except (ImportError, AttributeError, TypeError, ValueError):
        expected = False
    if not expected or getattr(put, "jaxtrain_whole", False):
        return

    def put_whole(self, key, value) -> None:
        directory = str(getattr(self, "path", ""))
        if not key or getattr(self, "eviction_enabled", True) or not os.path.isdir(directory):
            return put(self, key, value)
        entry = os.path.join(directory, f"{key}{suffix}")
        # A new name each time (ranks on other hosts of a shared directory, or in other pods, may
        # have this process id), made here and nowhere else (O_EXCL: never a file or link that
        # is there already), no longer than the entry's own (the key's last 64 characters are its
        # hash); the mode is JAX's, as the umask leaves it. An entry there already is replaced:
        # JAX did not load it (torn by a host that went down), or another rank wrote the same
        # program a moment ago.
        partial = os.path.join(directory, f".{key[-64:]}.{secrets.token_hex(8)}.partial")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with open(fd, "wb") as f:
                f.write(value)
            os.replace(partial, entry)
        except BaseException:
            try:
                os.unlink(partial)
            except OSError:
                pass
            raise
        return None

    put_whole.jaxtrain_whole = True
    cache_class.put = put_whole
