"""The native CRC-32C (hardware instruction in three interleaved streams, or the table) against the reference implementation, at every block boundary of the interleaved path."""

from __future__ import annotations

import os

import pytest

from activationscope.capture import _native

_C = _native.load()


def test_check_value():
    assert _C.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 767, 768, 769, 4096, 24575, 24576, 24577, 49157, 100_003, 1 << 20])
@pytest.mark.parametrize("offset", [0, 3, 5])
def test_matches_google_crc32c(n, offset):
    google_crc32c = pytest.importorskip("google_crc32c")
    data = os.urandom(n + offset)[offset:]
    assert _C.crc32c(data) == google_crc32c.value(data)
    # incremental: crc of a + b continues from crc of a
    cut = n // 3
    assert _C.crc32c(data[cut:], _C.crc32c(data[:cut])) == google_crc32c.value(data)
