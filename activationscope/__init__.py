"""ActivationScope: capture intermediate activations of PyTorch models with native hooks,
stream them into a chunked Zarr v3 store, compute online reductions, and read everything
back as zero-copy torch views.

Quick start::

    import activationscope

    with activationscope.ActivationScope().track(model) as tracker:
        out = model(x)
    acts = tracker.activations  # {hook_point: [Tensor per captured call]}

Names are loaded on first use: ``import activationscope`` imports neither torch nor the
native extension; ``activationscope.ActivationScope`` loads both (and raises
``NativeExtensionError`` if the extension does not match the installed torch).
"""

import importlib as _importlib

from .errors import (
    ActivationScopeError,
    CaptureError,
    HookPointNotFoundError,
    NativeExtensionError,
    ReductionError,
    ReductionNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
)

__version__ = "0.1.0"

# public name -> submodule that defines it (imported on first access)
_LAZY = {
    "ActivationScope": ".scope",
    "Tracker": ".scope",
    "CaptureMode": ".scope",
    "CapturePolicy": ".scope",
    "ReductionPolicy": ".scope",
    "StoragePolicy": ".scope",
    "open_store": ".store",
    "Store": ".store",
    "StoreWriter": ".store",
    "ActivationDataset": ".data",
    "to_dask": ".analysis.dask",
}

__all__ = [
    "ActivationScope",
    "Tracker",
    "CaptureMode",
    "CapturePolicy",
    "ReductionPolicy",
    "StoragePolicy",
    "open_store",
    "Store",
    "StoreWriter",
    "ActivationDataset",
    "to_dask",
    "ActivationScopeError",
    "CaptureError",
    "HookPointNotFoundError",
    "NativeExtensionError",
    "ReductionError",
    "ReductionNotFoundError",
    "StoreError",
    "StoreExistsError",
    "StoreCorruptError",
    "StoreLockedError",
    "__version__",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'activationscope' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
