"""Compressed chunks are encoded off the GIL: the encoders the writer uses release it."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from activationscope.store import _format as F


@pytest.mark.parametrize("compression", ["zstd", "blosc-lz4"])
def test_store_encoders_release_the_gil(compression):
    codec = F.codec_for_array(F.parse_compression(compression), "float32")
    encoder = F.numcodecs_encoder(codec)
    data = np.random.default_rng(0).standard_normal(2 << 20).astype(np.float32)  # 8 MiB
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    old = sys.getswitchinterval()
    # a C call that keeps the GIL cannot be preempted, so any progress during encode() means
    # the GIL was released (0.2 s: no forced switch in the few bytecodes around the call)
    sys.setswitchinterval(0.2)
    t = threading.Thread(target=spin)
    t.start()
    runs = []
    try:
        # on a loaded machine the spinning thread may get no core during one encode: try a few
        # times (an encoder that keeps the GIL lets it run in none of them)
        for _ in range(10):
            time.sleep(0.001)
            before = counter[0]
            encoder.encode(data)
            runs.append(counter[0] - before)
            if runs[-1] > 0:
                break
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()
    assert max(runs) > 0, runs  # the other thread ran while a chunk was being encoded
