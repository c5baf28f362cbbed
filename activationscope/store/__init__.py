"""The store: a Zarr v3 group of activation arrays, row tables and reductions.

Format: ``store/FORMAT.md`` (version 1). Write with :class:`StoreWriter` (normally through
``ActivationScope(store=...)``), read with :func:`open_store`.

Example
-------
>>> scope = ActivationScope(store="runs/demo.zarr")       # doctest: +SKIP
>>> with scope.track(model) as tracker:                     # doctest: +SKIP
...     model(x)
>>> store = open_store("runs/demo.zarr")                    # doctest: +SKIP
>>> store["0.output"]                                       # zero-copy view  # doctest: +SKIP
"""

from __future__ import annotations

from ..capture.writer import register_writer
from ._format import FORMAT_NAME, FORMAT_VERSION
from ._remove import remove_if_empty
from .reader import Store, copy_store, open_store
from .ranks import RankStore, commit_ranks, init_process_group, open_capture_writer
from .writer import StoreWriter, model_identity

# the writer of ActivationScope(store=...) captures: a StoreWriter, or a rank's RankWriter
register_writer(open_capture_writer)

__all__ = ["RankStore", "commit_ranks", "init_process_group", "StoreWriter", "Store", "open_store", "copy_store", "remove_if_empty",
           "model_identity", "FORMAT_NAME", "FORMAT_VERSION"]
