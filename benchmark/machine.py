"""Description of the machine a run was taken on."""

from __future__ import annotations

import os
import platform
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


PACKAGES = ("activationscope", "numpy", "zarr", "nnsight", "torchlens", "sae-lens", "transformer-lens", "safetensors",
            "datasets", "transformers")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the library and the peers (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def describe(threads: int) -> dict[str, Any]:
    """Machine facts printed at the top of a run and stored under ``machine`` in the JSON."""
    import numpy
    import torch

    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        mem = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu_model": cpu_model(),
        "n_cpus": os.cpu_count(),
        "n_cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_bytes": mem,
        "loadavg": list(load) if load else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": threads,
        "torch_interop_threads": 1,
        "torch_config_parallel": torch.__config__.parallel_info().splitlines()[0:3],
        "packages": package_versions(),
    }
