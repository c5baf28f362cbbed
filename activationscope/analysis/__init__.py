"""Analysis of captured activations: linear probes (:mod:`.probes`), pooling of token rows
(:mod:`.pooling`), PCA (:mod:`.pca`), the HTML report (:mod:`.report`), Dask arrays and data
frames over a store (:mod:`.dask`), capturing a model over a data set (:mod:`.capture_run`) and
the demo (:mod:`.demo`)."""
