"""jaxtrain._core lives in the same process as jaxlib (which bundles its own gRPC, protobuf and
abseil): importing both, in either order, must leave JAX working."""

import subprocess
import sys
from pathlib import Path

import pytest

ORDERS = {
    "jax_first": "import jax, jax.numpy as jnp\nimport jaxtrain, jaxtrain._core\n",
    "jaxtrain_first": "import jaxtrain, jaxtrain._core\nimport jax, jax.numpy as jnp\n",
}


def _python(code: str) -> str:
    """What a fresh Python running `code` printed (stripped); it must exit 0."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_jax_and_jaxtrain_load_together_and_jax_computes(order):
    code = ORDERS[order] + (
        "x = jax.jit(lambda a: (a * 2).sum())(jnp.arange(4.0))\n"
        "assert float(x) == 12.0, x\n"
        "jaxtrain.ScalingConfig(num_workers=2)\n"
        "print('ok')\n"
    )
    assert _python(code) == "ok"


def test_the_shipped_type_stubs_match_the_built_module(tmp_path):
    fresh = tmp_path / "_core.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-m", "jaxtrain._core", "-o",
                    str(fresh)], check=True, capture_output=True, timeout=120)
    shipped = Path(__file__).resolve().parent.parent / "python" / "jaxtrain" / "_core.pyi"
    assert fresh.read_text() == shipped.read_text(), (
        "python/jaxtrain/_core.pyi is stale: regenerate it with "
        "`.venv/bin/python -m nanobind.stubgen -m jaxtrain._core -o python/jaxtrain/_core.pyi`"
    )


def test_a_worker_imports_no_driver_module():
    """The package face imports its public names on first use: a worker process (its entry point
    and what the training function calls) loads nothing of the driver side."""
    code = (
        "import sys\n"
        "import jaxtrain, jaxtrain.worker.entry, jaxtrain.collective, jaxtrain.data\n"
        "from jaxtrain import get_context, report, Checkpoint\n"
        "print(' '.join(m for m in sys.modules\n"
        "               if m.startswith('jaxtrain.driver') or m == 'cloudpickle'))\n"
        "from jaxtrain import JaxTrainer\n"
        "assert JaxTrainer.__module__ == 'jaxtrain.driver.trainer', JaxTrainer.__module__\n"
    )
    assert _python(code) == ""


def test_the_package_face_names_every_public_name():
    import jaxtrain

    for name in jaxtrain.__all__:
        assert getattr(jaxtrain, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'trainer'"):
        jaxtrain.trainer  # noqa: B018
    assert sorted(jaxtrain.__all__) == sorted([*jaxtrain._HOMES, *jaxtrain._SUBMODULES])
