"""Argument checks shared by every layer (capture, store, data, analysis, CLI)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ArgumentTypeError


def parse_flag(value: Any, what: str) -> bool:
    """A True / False argument (``overwrite``, ``resume``, ``fsync``, ``verify``,
    ``same_samples``, ...) as a bool.

    Parameters
    ----------
    value : bool or numpy.bool_
    what : str
        The argument's name, for the message.

    Raises
    ------
    ArgumentTypeError
        Anything but a bool (a numpy bool is one): ``overwrite="False"``, from a config file or
        an environment variable, is a true string that would replace what is there.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{what} must be True or False, got {value!r}; pass a bool")
    return bool(value)
