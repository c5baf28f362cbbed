"""The package version (one definition: the facade and the store metadata read it)."""

__version__ = "0.1.0"
