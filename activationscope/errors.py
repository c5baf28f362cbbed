"""Errors raised by activationscope.

Every error is an :class:`ActivationScopeError`; most also inherit the builtin that fits, so
``except KeyError`` or ``except ValueError`` keep working.
"""

from __future__ import annotations

import os
import sys
import types
import unicodedata
import warnings
from collections.abc import Iterable


class ActivationScopeError(Exception):
    """Root of every error raised by activationscope."""


class ArgumentTypeError(ActivationScopeError, TypeError):
    """An argument of the wrong type (the message names the argument, expected and actual)."""


class ArgumentValueError(ActivationScopeError, ValueError):
    """An argument of the right type but an unsupported value (named, with the constraint)."""


class RowIndexError(ActivationScopeError, IndexError):
    """A row, row range or index outside the rows there are."""


class CaptureError(ActivationScopeError, RuntimeError):
    """A capture could not proceed (raised from the native hot path)."""


class IncompleteStoreWarning(UserWarning):
    """An analysis of an incomplete store (its capture stopped before it closed, or is still
    running) covers its committed samples only; the message names the store, the samples
    covered and the fix (resume the capture, or wait for it to close). A UserWarning."""


class FewerGroupsWarning(UserWarning):
    """A cross-validation by sample got fewer folds than asked because rows share sample ids
    (steps of one sample, or ids given again to other samples); the message names the groups
    and folds used. A UserWarning."""


class NonFiniteRowsWarning(UserWarning):
    """Rows holding NaN or inf were left out of a statistic, or made some of its values NaN
    or inf; the message says how many, which, and how to get the other behaviour. A
    UserWarning."""


class CaptureWarning(RuntimeWarning):
    """A capture records less than was asked for (modules that never ran, modules inside
    TorchScript, a partial forward, a forward whose hook points did not reach the stop point
    of ``stop_after_last``, a ``CaptureMode.REFERENCE`` record the model changed in place
    afterwards); the message names the modules and the fix. A RuntimeWarning.

    The warning about a ``set_batch`` attention mask that fits no hook point also carries
    ``reason == "mask_unused"``, ``mask_shape`` (the mask's shape, a tuple) and
    ``first_shapes`` (the hook points' first activation shapes, as shown in the message);
    the one about ``rows="token"`` finding no hook point that starts with the (batch, pos) of
    the model's first input carries ``reason == "token_rows_unused"`` and ``first_shapes``."""


class _MessageKeyError(ActivationScopeError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class HookPointNotFoundError(_MessageKeyError):
    """A hook point or pattern names nothing in the model or store."""


class ReductionNotFoundError(_MessageKeyError):
    """A hook point has no reduction (or reduction output) of the name asked for."""


class ColumnNotFoundError(_MessageKeyError):
    """A row-table or export column of that name does not exist (the message lists those that do)."""


class NativeExtensionError(ActivationScopeError, ImportError):
    """The native extension is missing or was built against another torch."""


class ReductionError(ActivationScopeError, ValueError):
    """A reduction was given with a wrong name, options or signature."""


class SpecError(ActivationScopeError, ValueError):
    """A model or data specification (``--model`` / ``--data`` of the command line) names
    nothing usable."""


class StoreError(ActivationScopeError, OSError):
    """A store could not be created, opened, written or committed."""


class StoreExistsError(StoreError, FileExistsError):
    """A store already exists where a new one was asked for."""


class ExportExistsError(ActivationScopeError, FileExistsError):
    """An export path holds something the export does not replace (a file or folder it did not
    write); it is left as it is, and the message names it and the fix."""


class ExportError(ActivationScopeError, OSError):
    """An export could not be written (a full disk, a folder that cannot be written); the
    message names the path, the cause and the fix. Nothing is left at the export's path (a
    file an ``overwrite`` was to replace stays as it was)."""


class StoreCorruptError(StoreError):
    """A store is damaged or breaks a rule of its format (FORMAT.md §9); the message names the
    file, what is wrong and the fix."""


class StoreLockedError(StoreError):
    """Another writer holds the store's writer lock (the message names its pid and host)."""


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line, for a command line or a progress log: the KeyError
    message unquoted, the class name in front for errors that are not ours or a builtin
    whose name says what went wrong."""
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args and not isinstance(e, HookPointNotFoundError) else str(e)
    text = " ".join(text.split()) or type(e).__name__
    if not isinstance(e, (ActivationScopeError, OSError, ValueError, KeyError, ImportError)):
        text = f"{type(e).__name__}: {text}"
    return text


def name_repr(name: object) -> str:
    """``repr(name)`` for a message or a listing, but ``ascii(name)`` for a str that is not in
    Unicode NFC form. A hook point ``d.\u00e9.output`` (one character) and ``d.e\u0301.output``
    (``e`` plus a combining accent) print alike; the second is shown with its escapes, as a
    command line shows a control character, so that a reader can tell them apart."""
    if isinstance(name, str) and not unicodedata.is_normalized("NFC", name):
        return ascii(name)
    return repr(name)


def names_repr(names: Iterable[object], n: int | None = None) -> str:
    """``[...]`` of :func:`name_repr` of each of ``names`` (the first ``n`` and ``...`` when
    there are more), for a message listing names that may print alike."""
    names = list(names)
    shown = names if n is None else names[:n]
    return "[" + ", ".join(name_repr(x) for x in shown) + (", ..." if len(shown) < len(names) else "") + "]"


def hook_point_hint(name: object, hook_points: Iterable[str], n: int = 3) -> str:
    """``"; did you mean [...]?"`` for a hook point name that is not one of ``hook_points``:
    for an fnmatch pattern given where one name is read, the hook points it would match; else
    the hook points of the module it names (``"blocks.0"`` for ``blocks.0.output``: a hook point
    is a module path plus ``.output`` or ``.input.<k>``), else up to ``n`` names closest to it
    (a typo; difflib's ratio of at least 0.8); ``""`` when none is close or ``name`` is no str."""
    import difflib

    if not isinstance(name, str) or not name:
        return ""
    names = [h for h in hook_points if isinstance(h, str)]
    if any(c in name for c in "*?["):
        import fnmatch

        hits = [h for h in names if fnmatch.fnmatchcase(h, name)]
        if hits:  # (a pattern where one hook point is read: store[...], to_dask)
            return (f"; {name_repr(name)} is read as one name, not a pattern (it would match {names_repr(hits, n)}): "
                    "pass one hook point")
    below = [h for h in names if h.startswith(name + ".")]
    if below:
        return (f"; did you mean {names_repr(below, n)}? (a hook point is a module path plus '.output' or "
                "'.input.<k>')")
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.8)
    return f"; did you mean {names_repr(close)}?" if close else ""


def docs_page(path: str, section: str | None = None) -> str:
    """How a message names a page of the documentation, which is not installed with the
    package: by its path in the source distribution (as in the repository), with the heading
    or bold paragraph lead of the part meant, e.g. ``section 'Custom reductions' of
    docs/usage/reductions.md (in activationscope's source distribution)``. Every message names
    pages through this (``tests/test_build.py`` checks that each page named is in the sdist
    and holds its section).

    Parameters
    ----------
    path : str
        The page's path from the root of the source distribution (``"docs/usage/store.md"``).
    section : str, optional
        A heading of the page, or the lead of a bold paragraph, as written there.
    """
    where = f"{path} (in activationscope's source distribution)"
    return f"section {section!r} of {where}" if section else where


def column_hint(missing: Iterable[str], columns: Iterable[str], n: int = 3) -> str:
    """``"; did you mean [...] for 'x'?"`` naming, for each of the ``missing`` column names
    that has any, up to ``n`` of ``columns`` closest to it (a typo: ``'lable'`` for
    ``'label'``; difflib's ratio of at least 0.8); ``""`` when none is close."""
    import difflib

    columns = [c for c in columns if isinstance(c, str)]
    found = [(m, difflib.get_close_matches(m, columns, n=n, cutoff=0.8)) for m in missing if isinstance(m, str)]
    found = [f"{names_repr(close)} for {name_repr(m)}" for m, close in found if close]
    return f"; did you mean {', '.join(found)}?" if found else ""


def _inside_library(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs code of this package, of torch or of the Python standard library
    (contextlib, threading, functools, runpy ...): the frames between a user's line and the
    place a warning is made."""
    name = frame.f_globals.get("__name__")
    if isinstance(name, str) and name.split(".", 1)[0] in ("activationscope", "torch"):
        return True  # (also code made by exec in our modules' globals: a dataclass's __init__)
    filename = frame.f_code.co_filename
    found = _LIBRARY_FILES.get(filename)
    if found is None:
        if filename.startswith("<frozen "):
            found = True
        else:
            path = os.path.abspath(filename)
            torch = sys.modules.get("torch")
            roots = [os.path.dirname(os.path.abspath(__file__))]
            if getattr(torch, "__file__", None):
                roots.append(os.path.dirname(os.path.abspath(torch.__file__)))
            found = any(path.startswith(root + os.sep) for root in roots) or (
                path.startswith(_STDLIB + os.sep)
                and not {"site-packages", "dist-packages"} & set(path[len(_STDLIB):].split(os.sep)))
        if len(_LIBRARY_FILES) < 4096:
            _LIBRARY_FILES[filename] = found
    return found


def _installed(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs code of an installed package (a file under ``site-packages`` or
    ``dist-packages``)."""
    filename = frame.f_code.co_filename
    found = _INSTALLED_FILES.get(filename)
    if found is None:
        found = bool({"site-packages", "dist-packages"} & set(os.path.abspath(filename).split(os.sep)))
        if len(_INSTALLED_FILES) < 4096:
            _INSTALLED_FILES[filename] = found
    return found


_STDLIB = os.path.dirname(os.path.abspath(os.__file__))
_INSTALLED_FILES: dict[str, bool] = {}
_LIBRARY_FILES: dict[str, bool] = {}


def warn_at_caller(message: str | Warning, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the first frame of
    the stack outside this package, torch and the standard library's helpers between them
    (the ``model(x)`` whose hook warned, the ``with scope.track(model)`` whose exit warned, the
    ``for batch in loader`` that read rows, ``StoreWriter(...)``). Its file and line are shown,
    and filters match its module (``warnings.filterwarnings(..., module=...)``), its ``once``
    and ``default`` actions its own registry, as for ``warnings.warn`` there.

    A warning made where no frame is the user's (a background thread of this package, a
    DataLoader worker started with spawn, the command line) is attributed to the line of this
    package that made it.

    Parameters
    ----------
    message : str or Warning
        The text, or a warning instance (its class is then the category).
    category : type of Warning
        The category of a text message (default ``UserWarning``).
    """
    issued = sys._getframe(1)
    # the outermost call of a torch module on the stack: the frames below it of installed
    # packages (a Hugging Face model's forward calling its blocks) are the model's, not the
    # user's, whose line is the one that called the model; a model of the user's own files
    # is named at its line that called the module
    outer = None
    g: types.FrameType | None = issued
    while g is not None:
        if g.f_globals.get("__name__") == "torch.nn.modules.module":
            outer = g
        g = g.f_back
    frame: types.FrameType | None = issued
    below = issued
    in_model = outer is not None
    while frame is not None and (_inside_library(frame) or (in_model and _installed(frame))):
        if frame is outer:
            in_model = False
        frame, below = frame.f_back, frame
    if frame is None or (frame.f_back is None and frame.f_code.co_filename == "<string>"
                         and below.f_code.co_filename.startswith(_STDLIB + os.sep)):
        # (the second: the ``python -c`` code of a process multiprocessing started with spawn)
        frame = issued
    if not isinstance(message, Warning):
        message = category(str(message))
    message._from_activationscope = True  # (how the command line tells the library's warnings)
    module_globals = frame.f_globals
    registry = module_globals.setdefault("__warningregistry__", {})
    # (as warnings.warn does it: no module_globals, whose loader may have no source to give)
    warnings.warn_explicit(message, type(message), frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"), registry=registry)
