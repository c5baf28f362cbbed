"""The writer interface of a capture: what a tracker needs from the store it streams into.

Capture does not import the store layer. ``activationscope.store`` registers its
:class:`~activationscope.store.StoreWriter` here when it is imported (``import activationscope``
then ``activationscope.ActivationScope`` imports it), and a tracker with ``store=`` asks
:func:`open_writer` for one. Another writer (a test fake, a different backend) registers
itself the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Protocol, runtime_checkable

from ..errors import CaptureError


@runtime_checkable
class ActivationWriter(Protocol):
    """A store being written by one capture.

    Attributes
    ----------
    n_samples_committed : int
        Samples already in the store when the writer opened (0 for a new store; resume
        continues after them).
    path : str
        Where it writes.
    next_sample_id : int, optional
        The id the running counter gives the next sample recorded without ids (resume: where
        the stored run left it, each sample counted once). A writer without it is continued
        from ``n_samples_committed``.
    """

    n_samples_committed: int

    @property
    def path(self) -> str: ...

    def open_array(self, hook_point: str, feature_shape: tuple, dtype: Any, row_kind: str) -> Any:
        """The native row consumer (``_C.RowConsumer``) of a new hook point's array;
        ``row_kind`` is ``"sample"`` or ``"token"``."""

    def add_batch(self, n_samples: int, sample_ids: Any = None, token_mask: Any = None,
                  columns: Mapping[str, Any] | None = None, described_again: bool = False,
                  next_id: int | None = None) -> None:
        """The row-table entries of one captured forward. ``described_again``: the forward
        reuses the previous forward's ``set_batch`` description (it is sticky), so its sample
        ids are those samples again (a generation loop), not ids to check for repeats.
        ``next_id`` (passed only when the forward repeats samples or follows skipped ones): the
        running counter of default ids after this forward, which a resume continues from
        (default: the counter before it plus ``n_samples``). Both are optional: a writer whose
        ``add_batch`` takes neither (nor ``**kwargs``) is given neither."""

    def maybe_commit(self) -> bool:
        """Commit what is durable when due; True when a commit happened."""

    def rows_since_last_batch(self) -> dict[str, int]:
        """Rows each array received since the last :meth:`add_batch` (a partial forward)."""

    def add_reductions(self, hook_point: str, name: str, reduction: Any, script_path: Any = None,
                       n_rows: int | None = None) -> None:
        """Store the state and result of a reduction of ``hook_point``, covering ``n_rows``
        rows of its array."""

    supported_dtypes: tuple[str, ...]
    """Names of the torch dtypes an array can hold (``"float32"``, ...)."""

    aliases: dict[str, str]
    """``{hook point: target}`` of hook points stored as another's array (resume: the stored ones)."""

    def add_alias(self, hook_point: str, target: str) -> None:
        """Store ``hook_point`` as ``target``'s array (the same tensor at every call)."""

    def committed_rows(self, hook_point: str) -> int:
        """Rows of ``hook_point`` committed before the writer opened (resume; 0 otherwise)."""

    def stored_dtype(self, hook_point: str) -> str | None:
        """Optional: the dtype name of ``hook_point``'s array when the writer opened (resume; a
        writer that keeps reductions only: of the rows it reduced), or None. A resume casts an
        integer hook point stored as ``storage_dtype`` (its first call was floating-point, or an
        earlier version cast every hook point) again; a writer without it keeps integers uncast."""

    def stored_reduction_state(self, hook_point: str, name: str, kind: str, options: Any = None, *,
                               script: Any = ...) -> Any:
        """``(state, rows covered)`` of a reduction stored by an earlier run with this kind and
        these options, or None (the reduction is then recomputed over the committed rows).
        ``script`` (given for custom reductions only): the resumed one's ``.pt`` path, or None
        when it runs as eager Python; the stored state is used only for the same program."""

    def read_committed_rows(self, hook_point: str, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of ``hook_point`` committed before the writer opened (a copy)."""

    stored_hook_points: list[str]
    """Hook points (arrays and aliases) the store held when the writer opened (resume; empty
    for a new store). Optional: a writer without it is not checked on resume."""

    stored_intermittent: list[str]
    """Stored hook points whose rows no longer follow the row table (``follows_row_table`` is
    False: first captured after some forwards, or missing from one): a resume does not need
    them in its first forward. Optional: without it, every stored hook point is needed there."""

    stored_capture_config: dict
    """The ``capture_config`` the store recorded when the writer opened (resume; empty for a
    new store). Optional: without it, a resume's include= / exclude= patterns are not checked."""

    def close(self, status: str = "complete") -> None:
        """Commit everything and mark the store ``status``."""

    def stopped_by(self, exc: BaseException) -> None:
        """Optional: the exception that left the capture's block, given just before
        ``close(status="incomplete")`` (a multi-rank writer tells the other ranks it)."""

    def discard(self) -> None:
        """Optional: close without committing anything of this run, leaving a resumed store as
        it was found (a refused resume); never raises. Writers without it are aborted."""

    def abort(self, exc: BaseException | None = None) -> None:
        """Leave the store at its last commit (status incomplete); never raises."""


#: ``factory(target, *, capture_config, model, storage_dtype, **store_options) -> ActivationWriter``;
#: a capture that keeps reductions only (``ReductionPolicy.STREAMING`` with ``store=``) also
#: passes ``reductions_only=True``, and then declares hook points with ``open_reduced`` and gives
#: ``add_batch(reduced_rows=...)`` (see :class:`activationscope.store.StoreWriter`)
WriterFactory = Callable[..., ActivationWriter]

_FIXED = ("target", "capture_config", "model", "storage_dtype", "reductions_only")
_factory: WriterFactory | None = None


def register_writer(factory: WriterFactory) -> None:
    """Make ``factory`` the writer of ``ActivationScope(store=...)`` captures.

    Parameters
    ----------
    factory : callable
        ``factory(target, *, capture_config, model, storage_dtype, **store_options)``; its other
        keyword-only parameters are the valid ``store_options``.
    """
    global _factory
    _factory = factory


def _require() -> WriterFactory:
    if _factory is None:
        raise CaptureError(
            "ActivationScope(store=...) needs a store writer, and none is registered; "
            "import activationscope.store first (activationscope.ActivationScope does)"
        )
    return _factory


def writer_options() -> list[str]:
    """The valid ``store_options`` of the registered writer, sorted."""
    params = inspect.signature(_require()).parameters
    return sorted(n for n, p in params.items() if n not in _FIXED and p.kind is p.KEYWORD_ONLY)


def check_writer_options(options: Mapping[str, Any]) -> None:
    """Check ``store_options`` values with the registered writer's ``check_options`` (a factory
    without one is checked when it opens); raises what that raises."""
    check = getattr(_require(), "check_options", None)
    if check is not None:
        check(**options)


def merges_reductions(target: Any, options: Mapping[str, Any]) -> bool:
    """Whether the registered writer's capture into ``target`` with ``store_options`` merges
    reduction states from several processes when it commits (the factory's optional
    ``merges_reductions(target, **options)``; False without one)."""
    check = getattr(_require(), "merges_reductions", None)
    return bool(check(target, **options)) if check is not None else False


def open_writer(target: Any, **kwargs: Any) -> ActivationWriter:
    """A writer for ``target`` from the registered factory (arguments as :data:`WriterFactory`)."""
    return _require()(target, **kwargs)
