"""Batch samplers for :class:`~activationscope.data.ActivationDataset`.

Every sampler yields *batches of dataset positions* (use it as ``DataLoader(ds,
batch_sampler=...)``) so that :meth:`ActivationDataset.__getitems__` reads a whole batch at
once. All are deterministic functions of ``(seed, epoch, rank, world_size)``; call
:meth:`set_epoch` before each epoch to reshuffle.

Splitting
---------
- Across ``torch.distributed`` ranks: the epoch's global order (identical on every rank,
  same seed) is cut into ``world_size`` contiguous parts whose sizes differ by at most one
  row; rank ``r`` batches part ``r``. The parts cover every position exactly once (no
  padding, no duplicates). ``even=True`` drops the ``len % world_size`` last positions of the
  global order instead, so every rank gets the same number of rows (and batches). Without it,
  parts one row apart may hold different numbers of batches: the samplers then warn
  (``UserWarning``), since a step that synchronises the ranks per batch (DDP) would wait
  forever on the rank with the extra batch.
- Across DataLoader workers: the DataLoader iterates the batch sampler in the main process
  and hands whole batches to workers, so workers never overlap or lose rows.

Samplers
--------
- :class:`SequentialBatchSampler`: store order; batches are ``range`` objects (contiguous
  rows, zero-copy views where the store allows).
- :class:`ShuffledBatchSampler`: a uniform random permutation of all positions per epoch.
- :class:`ChunkShuffleBatchSampler`: chunk-aware shuffling for large stores: shuffle the
  order of blocks (the store's shards, or ``block_rows``-row blocks), then shuffle rows
  within windows of consecutive blocks of about ``buffer_rows`` rows. See its docstring for
  how uniform that is.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from .._args import parse_flag
from ..errors import ArgumentTypeError, ArgumentValueError, warn_at_caller

__all__ = [
    "SequentialBatchSampler",
    "ShuffledBatchSampler",
    "ChunkShuffleBatchSampler",
    "partition_bounds",
]

_MASK64 = (1 << 64) - 1


def _int_arg(value: Any, name: str, low: int | None = None) -> int:
    """``value`` as an int: a Python, numpy or 0-d torch integer (``operator.index``), at
    least ``low`` when given.

    Raises
    ------
    ArgumentTypeError
        A bool, float, str or anything else that is no integer (``set_epoch(1.5)`` would
        otherwise share epoch 1's order).
    ArgumentValueError
        Below ``low``.
    """
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        # (operator.index reads a bool tensor as 0 / 1)
        raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None
    if low is not None and out < low:
        raise ArgumentValueError(f"{name} must be a positive int, got {out}" if low == 1 else f"{name} must be an int >= {low}, got {out}")
    return out


def _n_rows(data_source: Any) -> int:
    """The rows a sampler covers: ``len(data_source)``, or ``data_source`` itself when it is a
    row count (a Python, numpy or 0-d torch integer, at least 0).

    Raises
    ------
    ArgumentTypeError
        A bool, float or anything else that is neither sized nor an integer (a bool was taken
        as 1 row or 0, a numpy or 0-d torch integer raised Python's bare TypeError).
    ArgumentValueError
        A negative row count.
    """
    if isinstance(data_source, int) and not isinstance(data_source, bool) or not hasattr(type(data_source), "__len__") \
            or getattr(data_source, "ndim", None) == 0:  # (a 0-d tensor or array has a __len__ that raises)
        what = "data_source (a dataset, or a number of rows)"
        if isinstance(data_source, (int, torch.Tensor)) or hasattr(data_source, "__index__"):
            return _int_arg(data_source, what, 0)
        raise ArgumentTypeError(f"{what} must be a sized dataset or an int, got {data_source!r} ({type(data_source).__name__})")
    return len(data_source)


def _mix_seed(seed: int, epoch: int, salt: int = 0) -> int:
    """A 63-bit generator seed from (seed, epoch, salt): SplitMix64 finalizer (Steele et al., 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _dist_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    elif rank is None:
        # world_size given, rank left to its default: the default rank is only this process's
        # part when it comes from a process group of that size (every process taking part 0
        # would read the same rows, and the other parts none)
        world_size = _int_arg(world_size, "world_size", 1)
        group = dist.get_world_size() if initialised else None
        if world_size > 1 and group != world_size:
            where = (f"the torch.distributed process group has {group} ranks" if initialised
                     else "no torch.distributed process group is initialised to take it from")
            raise ArgumentValueError(
                f"world_size={world_size} was given without rank= and {where}: every process would take rank 0's "
                f"part (the same rows), and the other parts no process; pass rank= (this process's part, an int "
                f"in [0, {world_size}))"
            )
        rank = 0 if world_size == 1 else None
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    world_size = _int_arg(world_size, "world_size", 1)
    rank = _int_arg(rank, "rank")
    if not 0 <= rank < world_size:
        raise ArgumentValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size


def partition_bounds(n: int, rank: int, world_size: int, even: bool = False) -> tuple[int, int]:
    """Positions ``[start, stop)`` of the global order that belong to ``rank``.

    Parts are contiguous, disjoint and cover ``[0, n)`` (sizes ``n // world_size`` or one
    more); with ``even=True`` every part has ``n // world_size`` positions and the last
    ``n % world_size`` positions are left out.

    Parameters
    ----------
    n : int
        Number of positions (rows), at least 0.
    rank : int
        The part, in ``[0, world_size)``.
    world_size : int
        Number of parts, at least 1.
    even : bool, default False
        Give every part the same size (see above).

    Returns
    -------
    (int, int)
        ``(start, stop)`` with ``0 <= start <= stop <= n``.

    Raises
    ------
    ArgumentTypeError
        An argument that is no int (a bool, a float, ...), or ``even`` no bool; a TypeError.
    ArgumentValueError
        ``n`` below 0, ``world_size`` below 1, or ``rank`` outside ``[0, world_size)``; a
        ValueError.
    """
    n = _int_arg(n, "n", 0)
    even = parse_flag(even, "even")
    world_size = _int_arg(world_size, "world_size", 1)
    rank = _int_arg(rank, "rank")
    if not 0 <= rank < world_size:
        raise ArgumentValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if even:
        size = n // world_size
        return rank * size, (rank + 1) * size
    return (n * rank) // world_size, (n * (rank + 1)) // world_size


class _BatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        data_source: Any,
        batch_size: int,
        *,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        even: bool = False,
    ) -> None:
        batch_size = _int_arg(batch_size, "batch_size", 1)
        seed = _int_arg(seed, "seed")
        if not -(1 << 63) <= seed < 1 << 64:  # (as torch.manual_seed; the mix takes it modulo 2**64)
            raise ArgumentValueError(f"seed must be an int in [-2**63, 2**64), as torch.manual_seed takes, got {seed}")
        self.data_source = data_source
        self.n = _n_rows(data_source)
        self.batch_size = batch_size
        self.drop_last = parse_flag(drop_last, "drop_last")  # (drop_last="False" is a true string)
        self.seed = seed
        self.rank, self.world_size = _dist_defaults(rank, world_size)
        self.even = parse_flag(even, "even")
        self.epoch = 0
        self._warn_uneven_batches()
        if self._window_is_all:
            self._fit_cache(self.n)

    #: Whether the order is one shuffle of every row (its window: the whole dataset).
    _window_is_all = False

    def _fit_cache(self, window_rows: int) -> None:
        """Of an ActivationDataset's compressed or remote rows: a cache of decoded chunks that
        holds a window of ``window_rows`` rows, up to a bound, or a warning
        (:meth:`ActivationDataset.fit_cache_to_window`)."""
        fit = getattr(self.data_source, "fit_cache_to_window", None)
        if callable(fit) and self.n:
            fit(window_rows, type(self).__name__)

    def _warn_uneven_batches(self) -> None:
        """Warn when the ranks do not all read the same number of batches per epoch (parts of
        ``n // world_size`` and one more row on either side of a multiple of ``batch_size``): a
        step that synchronises the ranks on every batch (DistributedDataParallel's backward)
        waits forever on the rank with the extra batch, as ``DistributedSampler`` (which repeats
        rows to make the parts equal) never lets happen."""
        if self.world_size == 1 or self.even:
            return
        n, world, bs = self.n, self.world_size, self.batch_size
        counts = {}
        for r in {0, world - 1}:  # (parts grow with the rank: the first and last have the fewest and most rows)
            a, b = partition_bounds(n, r, world)
            counts[r] = (b - a) // bs if self.drop_last else -(-(b - a) // bs)
        if counts[0] != counts[world - 1]:
            warn_at_caller(
                f"{type(self).__name__}: the {world} ranks do not read the same number of batches per epoch "
                f"({n} rows in parts of {n // world} or {n // world + 1} rows, batch_size={bs}"
                f"{', drop_last=True' if self.drop_last else ''}: rank 0 reads {counts[0]}, rank {world - 1} reads "
                f"{counts[world - 1]}); a step that synchronises the ranks on every batch (DistributedDataParallel's "
                "backward, an all_reduce) waits forever on the rank with one batch more. Pass even=True for equal "
                f"parts (it leaves out the last {n % world} of the {n} rows of each epoch's order), or ignore this "
                "warning when the ranks do not synchronise per batch"
            )

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (call before each epoch; every rank with the same value)."""
        self.epoch = _int_arg(epoch, "epoch")

    def _bounds(self) -> tuple[int, int]:
        return partition_bounds(self.n, self.rank, self.world_size, self.even)

    def n_rows(self) -> int:
        """Rows this rank visits per epoch."""
        a, b = self._bounds()
        return b - a

    def __len__(self) -> int:
        rows = self.n_rows()
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def _order(self) -> torch.Tensor:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        a, b = self._bounds()
        part = self._order()[a:b]
        stop = len(self) * self.batch_size
        for i in range(0, min(stop, b - a), self.batch_size):
            yield part[i : i + self.batch_size].tolist()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={self.n}, batch_size={self.batch_size}, seed={self.seed}, "
            f"epoch={self.epoch}, rank={self.rank}, world_size={self.world_size})"
        )


class SequentialBatchSampler(_BatchSampler):
    """Batches of consecutive positions, in order.

    Parameters
    ----------
    data_source : ActivationDataset, sized object or int
        What to sample (its ``len``), or the number of rows (a Python, numpy or 0-d torch
        integer, at least 0; a bool or float raises ArgumentTypeError).
    batch_size : int
        Rows per batch (the last batch of a rank may be shorter unless ``drop_last``).
    drop_last : bool, default False
        Drop each rank's last incomplete batch.
    seed : int, default 0
        Unused (accepted for a uniform signature).
    rank, world_size : int, optional
        This process's part; default ``torch.distributed`` when initialised, else 0 / 1.
        ``world_size`` > 1 without ``rank`` raises ArgumentValueError unless the process
        group has that size (every process would take part 0).
    even : bool, default False
        Equal parts on every rank (see the module docstring). Without it, a UserWarning says
        when the ranks read different numbers of batches per epoch (a DDP step would hang).

    Integer arguments (and ``set_epoch``'s) take Python, numpy and 0-d torch integers; a
    bool, float or str raises ArgumentTypeError, a value out of range ArgumentValueError.
    ``drop_last`` and ``even`` take a bool (or numpy bool) only: ``"False"`` is a true string.

    Yields
    ------
    range
        Dataset positions ``[start, stop)`` of one batch (a sequence of ints).
    """

    def __iter__(self) -> Iterator[range]:  # type: ignore[override]
        a, b = self._bounds()
        stop = a + len(self) * self.batch_size
        for i in range(a, min(stop, b), self.batch_size):
            yield range(i, min(i + self.batch_size, b))


class ShuffledBatchSampler(_BatchSampler):
    """Batches of a uniformly random permutation of all positions (new each epoch).

    The permutation is ``torch.randperm(len, generator)`` seeded from ``(seed, epoch)``; every
    rank computes the same permutation and takes its contiguous part. Memory: 8 bytes per
    row for the permutation; built on an :class:`ActivationDataset` of compressed or remote
    rows, the store's cache of decoded chunks is raised to hold them all, up to 1 GiB (in
    each process), or a ``RuntimeWarning`` says why not (:meth:`ActivationDataset.fit_cache_to_window`).

    Parameters
    ----------
    data_source, batch_size, drop_last, rank, world_size, even
        As :class:`SequentialBatchSampler`.
    seed : int, default 0
        Base seed, identical on every rank: an int in [-2**63, 2**64), as torch.manual_seed takes.

    Yields
    ------
    list of int
        Dataset positions of one batch.
    """

    _window_is_all = True  # (its one window: every row)

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g)


class ChunkShuffleBatchSampler(_BatchSampler):
    """Chunk-aware shuffling: random block order, then a random permutation inside windows.

    Reading whole shards (blocks) in sequence keeps reads local (page cache, object storage,
    compressed chunk decoding) while still mixing rows:

    1. the blocks (the store's shards, or consecutive ``block_rows``-row blocks) are put in a
       uniformly random order;
    2. consecutive blocks of that order are grouped into *windows* of at least
       ``buffer_rows`` rows (the last window may be smaller);
    3. rows inside each window are uniformly permuted, and the windows are concatenated.

    How uniform: every row is visited exactly once per epoch; the window holding a given
    row is a uniformly random set of blocks, and within its window a row's position is
    uniform. Rows of the same block always share a window, so two rows of one block are
    about ``len / buffer_rows`` times more likely to share a batch than under a global
    shuffle, while two rows of different blocks share a window with probability about
    ``buffer_rows / len``. A batch (of at most ``buffer_rows`` rows) holds rows of at most
    two windows, i.e. of at most ``2 * ceil(buffer_rows / block)`` blocks of equal size. With
    ``buffer_rows >= len`` this is a global uniform shuffle; with ``buffer_rows <= block`` it
    shuffles rows within each block only. Cost: the order is built one window at a time as
    batches are taken, about 80 bytes per row of one window (``buffer_rows`` plus at most one
    block: its positions, then this rank's part of them as a Python list, which batches are
    slices of), whatever the dataset's length; the first batch comes after one window is
    built (a few milliseconds for 65536 rows). Built on an :class:`ActivationDataset` of
    compressed or remote rows (read by decoding chunks), the store's cache of decoded chunks
    is raised to hold one window, so that each chunk is decoded once a window that reads it,
    up to 1 GiB (in each process), or a ``RuntimeWarning`` says why not and what a window needs
    (:meth:`ActivationDataset.fit_cache_to_window`).

    Parameters
    ----------
    data_source : ActivationDataset or sized object or int
        What to sample. An ``ActivationDataset`` gives its shard boundaries
        (:meth:`ActivationDataset.block_boundaries`) unless ``block_rows`` is given.
    batch_size : int
        Rows per batch.
    buffer_rows : int, default 65536
        Rows per window (the shuffle buffer), counted in rows, not bytes.
    block_rows : int, optional
        Fixed block size in rows (default: the dataset's shard boundaries, or 4096 rows for
        sources without them).
    drop_last, seed, rank, world_size, even
        As :class:`ShuffledBatchSampler`.

    Yields
    ------
    list of int
        Dataset positions of one batch.
    """

    def __init__(
        self,
        data_source: Any,
        batch_size: int,
        *,
        buffer_rows: int = 65536,
        block_rows: int | None = None,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        even: bool = False,
    ) -> None:
        super().__init__(
            data_source, batch_size, drop_last=drop_last, seed=seed, rank=rank, world_size=world_size, even=even
        )
        buffer_rows = _int_arg(buffer_rows, "buffer_rows", 1)
        self.buffer_rows = buffer_rows
        if block_rows is not None:
            block_rows = _int_arg(block_rows, "block_rows", 1)
            bounds = torch.arange(0, self.n, block_rows, dtype=torch.int64)
        elif hasattr(data_source, "block_boundaries"):
            bounds = data_source.block_boundaries()[:-1]
            if bounds.numel() <= 1:  # one shard: use fixed blocks for locality of pages
                bounds = torch.arange(0, self.n, 4096, dtype=torch.int64)
        else:
            bounds = torch.arange(0, self.n, 4096, dtype=torch.int64)
        self.block_starts = bounds
        self.block_sizes = torch.diff(bounds, append=torch.tensor([self.n], dtype=torch.int64))
        # a window holds at most buffer_rows - 1 rows and the block that fills it: of an
        # ActivationDataset's compressed or remote rows, a cache of decoded chunks that holds
        # one, up to a bound, or a warning (ActivationDataset.fit_cache_to_window)
        #: The most rows a window holds (the whole dataset at most).
        self.window_rows = min(self.n, buffer_rows - 1 + int(self.block_sizes.max())) if self.n else 0
        if self.n:
            self._fit_cache(self.window_rows)

    def _windows(self, a: int, b: int) -> Iterator[tuple[int, np.ndarray | None]]:
        """The epoch's order one window at a time: ``(window's first position in the order,
        its rows)``, rows an int64 ndarray of dataset positions, or None for a window that ends
        at or before order position ``a`` (not built); it stops after the window holding
        position ``b - 1``. Memory: one window's rows (``buffer_rows`` plus at most one
        block), never the whole order. Every window's permutation is drawn in turn from one
        generator, skipped windows' too, so the order is the same whatever part is taken.

        A window is built by a few numpy passes over its rows (single-threaded: torch's
        intra-op threads cost more to wake than these passes take, and a core busy elsewhere
        stalls them), and its block boundaries are found by ``searchsorted``, not row by
        row or block by block in Python."""
        g = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch, salt=1))
        if self.n == 0:
            return
        perm = torch.randperm(self.block_starts.numel(), generator=g)
        starts = self.block_starts[perm].numpy().astype(np.int64, copy=False)
        sizes = self.block_sizes[perm].numpy().astype(np.int64, copy=False)
        ends = np.cumsum(sizes)  # order position after each block of the shuffled order
        # a window closes at the first block where it holds >= buffer_rows rows, or where the
        # order reaches n (empty blocks after that one belong to no window)
        win_start, first = 0, 0
        while True:
            k = int(np.searchsorted(ends, min(win_start + self.buffer_rows, self.n), side="left"))
            pos = int(ends[k])
            shuffle = torch.randperm(pos - win_start, generator=g)
            if pos <= a:
                yield win_start, None
            else:  # the rows of the window's blocks, in shuffled block order, then permuted
                s, z = starts[first : k + 1], sizes[first : k + 1]
                rows = np.repeat(s - (ends[first : k + 1] - z - win_start), z)
                rows += np.arange(pos - win_start, dtype=np.int64)
                yield win_start, rows[shuffle.numpy()]
            win_start, first = pos, k + 1
            if win_start >= b:
                return

    def __iter__(self) -> Iterator[list[int]]:
        # The batches of :meth:`_BatchSampler.__iter__` (this rank's part of the order, cut
        # into batch_size), taken from each window as it is built: the first batch comes after
        # one window, not after the order of every row of the epoch. Each window's part is
        # made a list once and batches are slices of it (per batch, one list slice).
        a, b = self._bounds()
        stop = a + len(self) * self.batch_size
        end = min(stop, b)
        if end <= a:
            return
        bs = self.batch_size
        carry: list[int] = []  # the rows of a batch begun in the previous window
        at = a  # order position of the next row to batch
        for win_start, rows in self._windows(a, end):
            if rows is None:
                continue
            lo, hi = max(at, win_start) - win_start, min(end, win_start + rows.shape[0]) - win_start
            if hi <= lo:
                break
            part = rows[lo:hi].tolist()
            at = win_start + hi
            i = 0
            if carry:
                i = bs - len(carry)
                carry += part[:i]
                if len(carry) == bs:
                    yield carry
                    carry = []
            n_full = i + max(0, len(part) - i) // bs * bs
            for j in range(i, n_full, bs):
                yield part[j : j + bs]
            if n_full < len(part):
                carry = part[n_full:]
            if at >= end:
                break
        if carry:
            yield carry
