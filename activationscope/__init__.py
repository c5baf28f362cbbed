"""ActivationScope: capture intermediate activations of PyTorch models with native hooks,
stream them into a chunked Zarr v3 store, compute online reductions, and read everything
back as zero-copy torch views.

Quick start::

    import activationscope

    with activationscope.ActivationScope().track(model) as tracker:
        out = model(x)
    acts = tracker.activations  # {hook_point: [Tensor per captured call]}
"""

from __future__ import annotations

from . import _native

_native.load()

from .errors import (  # noqa: E402
    ActivationScopeError,
    CaptureError,
    HookPointNotFoundError,
    NativeExtensionError,
    ReductionError,
    ReductionNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
)
from .scope import (  # noqa: E402
    ActivationScope,
    CaptureMode,
    CapturePolicy,
    ReductionPolicy,
    StoragePolicy,
    Tracker,
)

__version__ = "0.1.0"

__all__ = [
    "ActivationScope",
    "Tracker",
    "CaptureMode",
    "CapturePolicy",
    "ReductionPolicy",
    "StoragePolicy",
    "ActivationScopeError",
    "CaptureError",
    "HookPointNotFoundError",
    "NativeExtensionError",
    "ReductionError",
    "ReductionNotFoundError",
    "StoreError",
    "StoreExistsError",
    "StoreCorruptError",
    "__version__",
]


def __getattr__(name: str):
    # The store and dataset modules import zarr / pyarrow: load them on first use.
    if name in ("open_store", "Store", "StoreWriter"):
        from . import store

        return getattr(store, name)
    if name in ("ActivationDataset",):
        from . import data

        return getattr(data, name)
    raise AttributeError(f"module 'activationscope' has no attribute {name!r}")
