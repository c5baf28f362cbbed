"""Loading of the native extension ``activationscope._C`` with a clear error on mismatch."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from ..errors import ArgumentValueError, NativeExtensionError

_module: ModuleType | None = None

#: Names the Python side calls that the newest native sources added: an extension built
#: from older sources lacks them and is refused with the fix, not an AttributeError later.
REQUIRED = ("is_token_rows", "Sink.set_alias_of", "Sink.set_row_base", "Sink.set_stored", "Sink.wait_reductions", "ForwardWrapper.plan", "ForwardWrapper.set_kw_order", "_set_traced_call",
            "gather_rows", "RowCounts", "last_match")


def _has(mod: ModuleType, dotted: str) -> bool:
    obj: object = mod
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def check_pool_env() -> None:
    """Refuse a ``$ACS_STAGING_POOL_BYTES`` that is not a whole number of bytes (the native
    pool would otherwise fall back to its 1 GiB default without a word: a ``512MiB`` or ``1e9``
    meant as a cap would not be one). Called when an :class:`ActivationScope` is made."""
    raw = os.environ.get("ACS_STAGING_POOL_BYTES")
    if raw is None or raw == "":
        return
    if not (raw.isascii() and raw.isdigit()):
        raise ArgumentValueError(
            f"$ACS_STAGING_POOL_BYTES={raw!r} is not a whole number of bytes (at least 0): it caps the "
            "staging memory kept for reuse after in-memory captures; set it to bytes, such as "
            "536870912 for 512 MiB, or 0 to keep none, or unset it for the default of 1 GiB")


def in_source_checkout() -> bool:
    """Whether the package is imported from a source checkout (``setup.py`` and ``csrc/`` next
    to it) rather than from an installed wheel or sdist."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc"))


def rebuild_advice(built: str | None = None) -> str:
    """How to get an extension that matches the running torch, in the words of where the package
    comes from: a source checkout rebuilds in place; an installed package is built again from its
    sdist (or, ``built`` being the torch version the extension was built against, that torch is
    installed)."""
    if in_source_checkout():
        return "rebuild it with `pip install --no-build-isolation -e .` (or `make build`) in this environment"
    pin = f"install the torch it was built against (`pip install torch=={built}`) or " if built and built != "unknown" else ""
    return (f"{pin}build activationscope again against this torch, from its sdist, with build requirements installed "
            "first (`pip install setuptools wheel pybind11 ninja numpy`, then `pip install --no-build-isolation "
            "--no-binary activationscope --no-deps --force-reinstall activationscope`, or the sdist's path in place of "
            "the last word)")


def load() -> ModuleType:
    """Import ``activationscope._C`` and check it was built against the running torch.

    Raises
    ------
    NativeExtensionError
        The extension is missing, fails to load, was built against another torch version
        (the message names both versions), or was built from older sources (it lacks a name
        of ``REQUIRED``); the message says how to rebuild.
    """
    global _module
    if _module is not None:
        return _module
    fix = rebuild_advice()
    try:
        mod = importlib.import_module("activationscope._C")
    except ImportError as e:
        raise NativeExtensionError(
            f"the native extension activationscope._C could not be loaded ({e}); it must be built against "
            f"the installed torch {torch.__version__}: {fix}"
        ) from e
    built = getattr(mod, "TORCH_VERSION", "unknown")
    if built != torch.__version__:
        raise NativeExtensionError(
            f"activationscope._C was built against torch {built} but torch {torch.__version__} is installed; "
            f"{rebuild_advice(built)}"
        )
    missing = [name for name in REQUIRED if not _has(mod, name)]
    if missing:
        raise NativeExtensionError(
            f"activationscope._C was built from older sources (it lacks {missing}); {fix}"
        )
    _module = mod
    return mod


def optional() -> ModuleType | None:
    """The native extension when it loads and matches the running torch, else None.

    Reading a store never needs it (it is faster with it): readers call this, capture calls
    :func:`load`.
    """
    try:
        return load()
    except NativeExtensionError:
        return None
