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
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys

from .errors import (
    ActivationScopeError,
    CaptureError,
    CaptureWarning,
    FewerGroupsWarning,
    IncompleteStoreWarning,
    NonFiniteRowsWarning,
    HookPointNotFoundError,
    NativeExtensionError,
    ReductionError,
    ReductionNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
)

from ._version import __version__

# public name -> submodule that defines it (imported on first access)
_LAZY = {
    "ActivationScope": ".capture.scope",
    "Tracker": ".capture.scope",
    "CaptureMode": ".capture.scope",
    "CapturePolicy": ".capture.scope",
    "ReductionPolicy": ".capture.scope",
    "StoragePolicy": ".capture.scope",
    "open_store": ".store",
    "copy_store": ".store",
    "Store": ".store",
    "StoreWriter": ".store",
    "ActivationDataset": ".data",
    "to_dask": ".analysis.dask",
    "RankStore": ".store",
    "init_process_group": ".store",
}

__all__ = [
    "ActivationScope",
    "Tracker",
    "CaptureMode",
    "CapturePolicy",
    "ReductionPolicy",
    "StoragePolicy",
    "open_store",
    "copy_store",
    "Store",
    "StoreWriter",
    "ActivationDataset",
    "to_dask",
    "RankStore",
    "init_process_group",
    "ActivationScopeError",
    "CaptureError",
    "CaptureWarning",
    "FewerGroupsWarning",
    "IncompleteStoreWarning",
    "NonFiniteRowsWarning",
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


# Modules importable under the path the docs show, defined elsewhere in the layout.
_MODULE_ALIASES = {f"{__name__}.reductions": f"{__name__}.capture.reductions"}


class _AliasFinder(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """``import activationscope.reductions`` gives the module ``activationscope.capture.reductions``
    itself (one module object, loaded on first import)."""

    def find_spec(self, fullname, path, target=None):
        if fullname in _MODULE_ALIASES:
            return _importlib_util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return _importlib.import_module(_MODULE_ALIASES[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _AliasFinder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'activationscope' has no attribute {name!r}")
    if module == ".capture.scope":
        # The store layer registers its writer with capture (capture never imports store).
        _importlib.import_module(".store", __name__)
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
