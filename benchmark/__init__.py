"""ActivationScope benchmarks: ``python -m benchmark.runner`` (see ``benchmark/README.md``)."""
