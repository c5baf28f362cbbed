"""activationscope.sizes: the one byte formatter (binary units) and folder size."""

from __future__ import annotations

import os

import pytest

from activationscope.sizes import dir_bytes, format_bytes


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (32768, "32.0 KiB"),
        (9 * 10**6, "8.6 MiB"), (64 << 20, "64.0 MiB"), (3 << 30, "3.0 GiB"), (5 << 40, "5.0 TiB"),
        (2048 << 40, "2048.0 TiB"), (-2048, "-2.0 KiB"), (1.5e6, "1.4 MiB"),
        (None, "-"), ("12", "-"), (True, "-"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_dir_bytes_sums_every_file(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "sub" / "b").write_bytes(b"y" * 100)
    (tmp_path / "sub" / "deep" / "c").write_bytes(b"z" * 1000)
    assert dir_bytes(tmp_path) == 1110
    assert dir_bytes(str(tmp_path / "sub")) == 1100
    assert dir_bytes(tmp_path / "a") == 10
    assert dir_bytes(tmp_path / "missing") == 0
    assert dir_bytes("s3://bucket/store.zarr") == 0


def test_one_formatter_in_the_code():
    """No module keeps its own byte formatter next to activationscope.sizes."""
    root = os.path.join(os.path.dirname(__file__), "..")
    for folder in ("activationscope", "benchmark"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if name.endswith(".py") and name != "sizes.py":
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                    for needle in ("def _fmt_bytes", "def fmt_bytes", "def format_bytes", "def _dir_bytes", "def dir_bytes"):
                        assert needle not in text, f"{needle} in {folder}/{name}"
