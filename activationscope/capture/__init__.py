"""Capture: the scope and tracker, hook-point selection, reductions and the native extension."""
