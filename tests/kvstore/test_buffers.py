"""What a put/get accepts (kvstore/net/buffers.py): torch tensors are recognized as torch
tensors, never by duck typing, and the module works in a process without torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstore.net.buffers import Dest, source_bytes


class LooksLikeATensor(bytearray):
    """Bytes-like, with a tensor-ish attribute: a buffer, not a tensor."""

    is_cuda = False


def test_a_bytes_like_value_with_is_cuda_is_a_buffer():
    value = LooksLikeATensor(b"abcd")
    assert source_bytes(value).tobytes() == b"abcd"
    dest = Dest(value)
    dest.array[:] = np.frombuffer(b"wxyz", np.uint8)
    assert bytes(value) == b"wxyz" and not dest.staged


def test_cpu_tensors_are_used_in_place():
    src = torch.arange(8, dtype=torch.int16)
    assert source_bytes(src).tobytes() == src.numpy().tobytes()
    dst = torch.zeros(8, dtype=torch.int16)
    Dest(dst).array[:] = source_bytes(src)
    assert torch.equal(dst, src)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_buffers_work_without_torch_loaded():
    code = ("import sys, numpy as np\n"
            "from kvstore.net.buffers import Dest, source_bytes\n"
            "assert source_bytes(b'ab').tobytes() == b'ab'\n"
            "Dest(bytearray(4)); Dest(np.zeros(4, np.uint8))\n"
            "assert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
