"""GPU check: one jaxtrain worker with ``use_gpu=True`` computes on the GPU and reports its devices.

    .venv/bin/python bench/gpu_check.py            # --gpus-per-worker 1 --size 4096 --repeats 20

Needs an NVIDIA GPU and CUDA-enabled JAX (``pip install "jax[cuda12]"``); without them it says what
is missing and exits 2. It does not simulate: JAXTRAIN_SIMULATE and JAXTRAIN_HOSTS are removed.

The worker prints ``jax.devices()`` and the environment placement gave it (CUDA_VISIBLE_DEVICES,
JAX_PLATFORMS, the local_device_ids jax.distributed was initialised with), then times a float32
matmul. The floor is the same matmul in a bare Python process that imports JAX with the same
CUDA_VISIBLE_DEVICES; the ratio jaxtrain/floor should be about 1.00 x. Exit status 0 when the
worker's devices are GPUs and its result is right, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import subprocess
import sys
import tempfile


def _matmul(size: int, repeats: int) -> dict:
    """Times a jitted float32 ``ones @ ones``; shared by the worker and the bare process."""
    import time

    import jax
    import jax.numpy as jnp

    x = jnp.ones((size, size), dtype=jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()  # compile outside the timed region
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        y = f(x).block_until_ready()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median_s": times[len(times) // 2], "value": float(y[0, 0]),
            "devices": [str(d) for d in jax.devices()], "platform": jax.devices()[0].platform}


def _on_gpu(config):
    import os

    import jax

    from jaxtrain import report
    from jaxtrain.worker.entry import _local_device_ids

    measured = _matmul(config["size"], config["repeats"])
    report({
        "devices": json.dumps(measured["devices"]),
        "device_kind": jax.devices()[0].device_kind,
        "platform": measured["platform"],
        "local_devices": len(jax.local_devices()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
        "jax_platforms": os.environ.get("JAX_PLATFORMS", "<unset>"),
        "local_device_ids": json.dumps(_local_device_ids("cuda")),
        "median_s": measured["median_s"],
        "value": measured["value"],
    })


def _missing() -> str | None:
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "no /dev/nvidia<N> devices: this machine has no NVIDIA GPU"
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.devices('cuda'))"],
        capture_output=True, text=True, timeout=300,
    )
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"JAX has no CUDA backend here ({tail}); install jax[cuda12]"
    return None


def _floor(cuda_visible_devices: str, size: int, repeats: int) -> dict:
    code = (inspect.getsource(_matmul)
            + f"\nimport json\nprint(json.dumps(_matmul({size}, {repeats})))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=cuda_visible_devices, JAX_PLATFORMS="cuda")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus-per-worker", type=int, default=1)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for name in ("JAXTRAIN_SIMULATE", "JAXTRAIN_HOSTS"):
        os.environ.pop(name, None)
    missing = _missing()
    if missing:
        print(f"gpu_check: skipped: {missing}")
        return 2

    from jaxtrain import JaxTrainer, RunConfig, ScalingConfig, _core

    scaling = ScalingConfig(num_workers=1, use_gpu=True,
                            resources_per_worker={"GPU": args.gpus_per_worker})
    plan = _core.plan_local(scaling._core).to_dict()
    print("plan:", json.dumps(plan["workers"][0], sort_keys=True))
    with tempfile.TemporaryDirectory() as storage:
        result = JaxTrainer(
            _on_gpu,
            train_loop_config={"size": args.size, "repeats": args.repeats},
            scaling_config=scaling,
            run_config=RunConfig(name="gpu_check", storage_path=storage),
        ).fit()
    m = result.metrics
    print(f"worker jax.devices(): {json.loads(m['devices'])}")
    print(f"device kind: {m['device_kind']}; local devices: {m['local_devices']}")
    print(f"CUDA_VISIBLE_DEVICES={m['cuda_visible_devices']} JAX_PLATFORMS={m['jax_platforms']} "
          f"local_device_ids={m['local_device_ids']}")
    floor = _floor(m["cuda_visible_devices"], args.size, args.repeats)
    ratio = m["median_s"] / floor["median_s"]
    print(f"{args.size}x{args.size} float32 matmul, median of {args.repeats}: "
          f"jaxtrain worker {m['median_s'] * 1e3:.3f} ms, bare process "
          f"{floor['median_s'] * 1e3:.3f} ms, ratio {ratio:.2f} x")
    ok = (m["platform"] == "gpu" and m["value"] == args.size
          and m["cuda_visible_devices"] == plan["workers"][0]["env"]["CUDA_VISIBLE_DEVICES"]
          and m["local_devices"] == args.gpus_per_worker)
    print("gpu_check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
