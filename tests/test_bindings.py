"""The engine's Python bindings (jaxtrain._core): the controller takes its options by name, and a
wrong one is a TypeError that names it, in the module built for this Python and in the
stable-ABI wheel alike."""

from __future__ import annotations

import pytest

from jaxtrain import _core


def test_the_controller_names_an_unknown_a_mistyped_and_a_missing_option():
    with pytest.raises(TypeError, match="unknown option 'bogus'"):
        _core.Controller(bogus=1)
    with pytest.raises(TypeError, match=r"option 'run_dir' does not take 5 \(<class 'int'>\)"):
        _core.Controller(run_dir=5)
    with pytest.raises(TypeError, match="is missing the option 'experiment_name'"):
        _core.Controller(run_dir="x")
