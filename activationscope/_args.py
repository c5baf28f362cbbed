"""Argument checks shared by every layer (capture, store, data, analysis, CLI)."""

from __future__ import annotations

import unicodedata
from typing import Any, Optional

import numpy as np

from .errors import ArgumentTypeError, ReductionError


def parse_flag(value: Any, what: str) -> bool:
    """A True / False argument (``overwrite``, ``resume``, ``fsync``, ``verify``,
    ``same_samples``, ...) as a bool.

    Parameters
    ----------
    value : bool or numpy.bool_
    what : str
        The argument's name, for the message.

    Raises
    ------
    ArgumentTypeError
        Anything but a bool (a numpy bool is one): ``overwrite="False"``, from a config file or
        an environment variable, is a true string that would replace what is there.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{what} must be True or False, got {value!r}; pass a bool")
    return bool(value)


def _folded(name: str) -> str:
    """``name`` as a file system that folds case and Unicode normalization (macOS, Windows)
    compares it."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", name).casefold())


#: Characters no Windows file name holds (nor a macOS SMB share's), with NUL and the control
#: characters U+0001 .. U+001F (FORMAT.md section 1 escapes them in hook points' folders).
_NOT_PORTABLE = '<>:"|?*' + "".join(chr(c) for c in range(0, 32))
#: Windows device names: a file named so, with any extension (``nul.txt``), cannot be made.
_DEVICE_NAMES = frozenset(["CON", "PRN", "AUX", "NUL", *(f"{d}{i}" for d in ("COM", "LPT") for i in "0123456789¹²³")])


def unportable_name(name: str) -> Optional[str]:
    """Why ``name`` cannot be one file or folder name on every file system a store may be copied
    to (Windows, a share macOS mounts from one) or one Zarr node name, or None when it can: a
    character of ``<>:"|?*``, NUL or U+0001 .. U+001F, a last ``.`` or space, a Windows device
    name before its first ``.`` (``con``, ``nul.txt``, any case), a leading ``__`` (reserved
    by Zarr), or the name of a file a resume keeps (``mean%2Fc%2F0.committed.tmp``, FORMAT.md
    section 6)."""
    bad = sorted({c for c in name if c in _NOT_PORTABLE})
    if bad:
        return f"holds {', '.join(ascii(c) for c in bad)}, which a Windows file name cannot hold"
    if name and name[-1] in ". ":
        return "ends in a '.' or space, which Windows drops from a file name"
    base = name.split(".", 1)[0].rstrip(" ")
    if base.upper() in _DEVICE_NAMES and all(c.isascii() or c in "¹²³" for c in base):
        return f"is the Windows device name {base!r} (before its first '.'), which no Windows file can be named"
    if name.startswith("__"):
        return "starts with '__', which Zarr reserves"
    if "%2f" in _folded(name) and _folded(name).endswith(".committed.tmp"):
        return ("is spelled as the file a resume keeps of another reduction's file (its path with '/' as '%2F', plus "
                "'.committed.tmp'), where a folder makes the store refuse every resume")
    return None


def check_reduction_name(name: Any, where: str = "", *, portable: bool = True) -> None:
    """A reduction's name names the arrays ``reductions/<hook point>/<name>[.<key>]`` of a
    store: it must be one store node name (not empty, no ``/`` or ``\\``, not ``.``, ``..``
    or ``zarr.json``, at most 100 UTF-8 bytes) that every file system holds as it is (none of
    :func:`unportable_name`'s problems).

    Parameters
    ----------
    name : str
    where : str
        Named in the error after the name (``" (hook point 'fc.output')"``).
    portable : bool
        False: a name :func:`unportable_name` refuses is let through (NUL excepted), for a
        reduction a store written before the rule already holds under that name.

    Raises
    ------
    ReductionError
        A name that is not one, naming it and the fix.
    """
    if isinstance(name, str) and len(name.encode("utf-8", "surrogatepass")) > 100:
        raise ReductionError(
            f"reduction name must be at most 100 UTF-8 bytes (it names the files reductions/<hook point>/<name>.<key> "
            f"of a store), got {len(name.encode('utf-8', 'surrogatepass'))} bytes ({name[:40]!r}...){where}; give a "
            "shorter one with (name, spec)"
        )
    if (not isinstance(name, str) or not name or name in (".", "..") or _folded(name) == "zarr.json" or "/" in name
            or "\\" in name):
        raise ReductionError(
            f"reduction name must be a non-empty str without '/' or '\\', and not '.', '..' or 'zarr.json' (in any case) "
            f"(it names the arrays reductions/<hook point>/<name> of a store), got {name!r}{where}; "
            "give another with (name, spec)"
        )
    why = unportable_name(name) if portable or "\x00" in name else None
    if why is not None:
        raise ReductionError(
            f"reduction name must be a name every file system holds as it is (it names the arrays "
            f"reductions/<hook point>/<name> of a store, which a copy to Windows or to a share macOS mounts from one "
            f"must hold as they are), got "
            f"{name!r}{where}, which {why}; give another with (name, spec), e.g. {_portable_example(name)!r}"
        )


def _portable_example(name: str) -> str:
    """``name`` with what :func:`unportable_name` refuses (and ``%``) replaced by ``_``."""
    out = "".join("_" if c in _NOT_PORTABLE + "%" else c for c in name).rstrip(". ") or "r"
    if unportable_name(out) is not None:
        out = "r_" + out.lstrip("_")
    return out
