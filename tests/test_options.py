"""The engine's options (jaxtrain.driver.options): every JAXTRAIN_* switch fit() reads, checked
once, and the one table of them in docs/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxtrain.driver import options
from jaxtrain.driver.options import EngineOptions

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_unset_switches_give_the_defaults():
    got = EngineOptions.read({})
    assert got == EngineOptions()
    assert got.verify_checksums and got.compilation_cache == "1" and not got.private
    assert got.metrics_endpoint is None


@pytest.mark.parametrize("name,value,allowed", [
    ("JAXTRAIN_VERIFY_CHECKSUMS", "yes", "use 1 (the default: a restore checks every file's "
                                         "size and CRC-32C) or 0 (sizes only)"),
    ("JAXTRAIN_VERIFY_CHECKSUMS", "off", "use 1"),
    ("JAXTRAIN_PRIVATE", "true", "use 1 (the run directory is 0700"),
    ("JAXTRAIN_COMPILATION_CACHE", "2", "use 1 (the default"),
    ("JAXTRAIN_STORE_DIRECT", "yes", "use 1 (the workers upload"),
    ("JAXTRAIN_CHECKPOINT_SNAPSHOT_MIB", "1G", "use a whole number of MiB >= 0"),
    ("JAXTRAIN_METRICS_PORT", "70000", "it must be a port number"),
    ("JAXTRAIN_GCE_METADATA", "on", "use 1 (watch the GCE metadata server"),
    ("JAXTRAIN_WORKING_DIR_MAX_MIB", "0", "use a whole number of MiB above 0"),
    ("JAXTRAIN_VERBOSE", "yes", "use 1 (the console and the rank logs also say"),
    ("JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S", "0", "use a number of seconds > 0 that the progress"),
    ("JAXTRAIN_PROGRESS_TIMEOUT_FLOOR_S", "10m", "use a number of seconds > 0"),
])
def test_a_bad_value_is_refused_naming_the_variable_the_value_and_what_is_allowed(
        name, value, allowed):
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is not allowed; {allowed}")):
        EngineOptions.read({name: value})


def test_verbose_is_on_only_when_set_to_1():
    assert EngineOptions.read({"JAXTRAIN_VERBOSE": "1"}).verbose
    assert not any(EngineOptions.read(env).verbose
                   for env in ({}, {"JAXTRAIN_VERBOSE": ""}, {"JAXTRAIN_VERBOSE": "0"}))


def test_verify_checksums_is_off_only_when_set_to_0():
    assert EngineOptions.read({"JAXTRAIN_VERIFY_CHECKSUMS": "1"}).verify_checksums
    assert EngineOptions.read({"JAXTRAIN_VERIFY_CHECKSUMS": ""}).verify_checksums
    assert not EngineOptions.read({"JAXTRAIN_VERIFY_CHECKSUMS": "0"}).verify_checksums


def test_a_run_is_private_when_asked_or_when_memory_holds_its_checkpoints(tmp_path):
    assert EngineOptions.read({"JAXTRAIN_PRIVATE": "1"}).private
    assert not EngineOptions.read({"JAXTRAIN_PRIVATE": "0"}).private
    in_memory = {"JAXTRAIN_CHECKPOINT_IN_MEMORY": "1", "JAXTRAIN_MEMORY_DIR": str(tmp_path)}
    assert EngineOptions.read(in_memory).private
    assert not EngineOptions.read({**in_memory, "JAXTRAIN_PRIVATE": "0"}).private


def test_run_configs_metrics_port_wins_over_the_variable():
    environ = {"JAXTRAIN_METRICS_PORT": "9100", "JAXTRAIN_METRICS_HOST": "0.0.0.0"}
    assert EngineOptions.read(environ).metrics_endpoint == ("0.0.0.0", 9100)
    assert EngineOptions.read(environ, metrics_port=0).metrics_endpoint == ("0.0.0.0", 0)


def test_the_docs_table_lists_every_option():
    table = DOCS.read_text()
    names = [v for k, v in vars(options).items() if k.endswith("_ENV") and isinstance(v, str)]
    assert names
    for name in names:
        assert f"| `{name}` |" in table, f"docs/configuration.md has no row for {name}"
