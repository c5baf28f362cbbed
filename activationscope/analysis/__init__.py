"""Analysis of stores: Dask arrays and data frames over a store (:mod:`.dask`)."""
