"""Errors raised by activationscope.

Every error is an :class:`ActivationScopeError`; most also inherit the builtin that fits, so
``except KeyError`` or ``except ValueError`` keep working.
"""

from __future__ import annotations


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


def stacklevel_outside_package() -> int:
    """The ``stacklevel`` of a ``warnings.warn`` made by the caller of this function that
    attributes the warning to the first frame outside this package: the user's line (the
    ``with scope.track(model)``, the ``StoreWriter(...)``), however many of our frames lie
    between (a one-process or a multi-rank capture open the store through other calls)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level  # (the outermost frame when every one is ours)
