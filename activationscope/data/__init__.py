"""Reading stores back for training and analysis.

- :class:`ActivationDataset`: a map-style torch dataset over the rows of a store (zero-copy
  views where the store is uncompressed), with row selection and row-table filters.
- Batch samplers: :class:`SequentialBatchSampler`, :class:`ShuffledBatchSampler`,
  :class:`ChunkShuffleBatchSampler` (deterministic from seed and epoch, split across
  ``torch.distributed`` ranks and DataLoader workers).
- Export: :func:`export_arrow`, :func:`export_parquet`, :func:`export_hf` (a Hugging Face
  ``datasets`` dataset, also in SAELens's cached-activations layout), and :func:`read_arrow`
  (Arrow IPC back as zero-copy torch views), :func:`to_pandas` (an export as a DataFrame).
"""

from __future__ import annotations

from .dataset import ActivationDataset, Batch, collate
from .export import (
    EXPORT_COMPRESSIONS,
    EXPORT_FORMAT,
    EXPORT_FORMAT_OPTIONS,
    EXPORT_FORMATS,
    arrow_to_torch,
    check_compression,
    check_format_options,
    export_arrow,
    export_hf,
    export_parquet,
    read_arrow,
    to_pandas,
)
from .samplers import ChunkShuffleBatchSampler, SequentialBatchSampler, ShuffledBatchSampler, partition_bounds

__all__ = [
    "ActivationDataset",
    "Batch",
    "collate",
    "SequentialBatchSampler",
    "ShuffledBatchSampler",
    "ChunkShuffleBatchSampler",
    "partition_bounds",
    "export_arrow",
    "export_parquet",
    "export_hf",
    "to_pandas",
    "read_arrow",
    "arrow_to_torch",
    "EXPORT_FORMAT",
    "EXPORT_FORMATS",
    "EXPORT_FORMAT_OPTIONS",
    "EXPORT_COMPRESSIONS",
    "check_format_options",
    "check_compression",
]
