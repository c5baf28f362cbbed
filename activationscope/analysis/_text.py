"""Reading text files that are not UTF-8 (private; shared by the demo's data and ``--data``)."""

from __future__ import annotations

#: Bytes 0x80-0x9F as Windows-1252 reads them (``€``, ``…``, ``’``, ``—`` ...); latin-1 makes
#: them C1 control characters, which no text means and tokenizers drop. The five bytes that
#: Windows-1252 leaves undefined (0x81, 0x8D, 0x8F, 0x90, 0x9D) stay the control characters
#: latin-1 gives them (as the WHATWG Encoding Standard decodes "windows-1252" and "latin1").
_WINDOWS_1252 = {b: bytes([b]).decode("cp1252") for b in range(0x80, 0xA0) if b not in (0x81, 0x8D, 0x8F, 0x90, 0x9D)}


def decode_windows_1252(data: bytes) -> str:
    """``data`` decoded as Windows-1252, the superset of latin-1 that a text file that is not
    UTF-8 is written in (gensim's ``pang_lee_polarity.cor`` spells its em dashes 0x97): bytes
    0xA0-0xFF and 0x00-0x7F as latin-1, 0x80-0x9F as the punctuation Windows-1252 gives
    them, the five it leaves undefined as the C1 controls of latin-1. Never fails."""
    return data.decode("latin-1").translate(_WINDOWS_1252)
