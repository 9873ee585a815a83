"""CUDA IPC of one device buffer: the daemon exports its GPU tier's handle, a same-host
process opens it once and copies blocks device to device at offsets into it.

Which IPC: torch's own (``torch.UntypedStorage._share_cuda_()`` in the exporter,
``torch.UntypedStorage._new_shared_cuda(...)`` in the importer), not CuPy's
``cupy.cuda.runtime.ipcGetMemHandle``/``ipcOpenMemHandle``. The tier buffer is a tensor of
torch's caching allocator, whose pointer need not be the base of its ``cudaMalloc``
allocation (``cudaIpcGetMemHandle`` wants the base); ``_share_cuda_`` returns the handle of
the allocation with the buffer's offset in it, records an event the importer waits for, and
keeps a reference count in shared memory so the exporter's memory outlives every importer.
CuPy would add a second CUDA runtime binding for the same few calls and is not a
dependency (``pyproject.toml``'s ``cuda12``/``cuda13`` extras only).

The handle travels as JSON (``export``: bytes as hex) in the GPU_HANDLE answer
(``kvstore.net.protocol``). ``open_buffer`` maps it on the local device with the exporter's
GPU UUID (``CUDA_VISIBLE_DEVICES`` may number devices differently in the two processes), or
raises ``Unsupported`` when this process has no CUDA or cannot see that GPU.

This module never imports torch (a process that never loads it, such as the router, does
not get it through the client): the exporter's torch is the one its tier already loaded, the
importer's the one its CUDA tensors come from (``sys.modules``).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from kvstore.errors import Unsupported

__all__ = ["cuda_missing", "require_cuda", "export", "open_buffer", "NEEDS_CUDA"]

NEEDS_CUDA = ("CUDA IPC (Client.get_cuda/put_cuda) needs torch with a CUDA device in this "
              "process: {why}; Client.get/put stage CUDA tensors through host memory instead")


def cuda_missing() -> str | None:
    """Why this process cannot use CUDA IPC, or None when it can."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not loaded (pass CUDA tensors)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU, or a CPU-only torch)"
    return None


def require_cuda() -> ModuleType:
    """torch, or ``Unsupported`` saying why CUDA IPC cannot run here."""
    why = cuda_missing()
    if why is not None:
        raise Unsupported(NEEDS_CUDA.format(why=why))
    return sys.modules["torch"]


def _uuid(torch: Any, device: int) -> str | None:
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):
        return None


def _hex(b: Any) -> str | None:
    return None if b is None else bytes(b).hex()


def _unhex(s: str | None) -> bytes | None:
    return None if s is None else bytes.fromhex(s)


def export(buf: Any) -> dict[str, Any]:
    """The IPC handle of ``buf`` (a whole CUDA uint8 tensor) as JSON-able values."""
    torch = sys.modules["torch"]
    if buf.device.type != "cuda":
        raise Unsupported(f"the GPU tier lives on {buf.device}, not a CUDA device: nothing to "
                          "export over CUDA IPC")
    (device, handle, size, offset, ref, ref_offset, event, event_sync) = (
        buf.untyped_storage()._share_cuda_())
    return {"device": int(device), "uuid": _uuid(torch, int(device)), "handle": _hex(handle),
            "storage_size": int(size), "storage_offset": int(offset), "ref_counter": _hex(ref),
            "ref_offset": int(ref_offset), "event": _hex(event), "event_sync": bool(event_sync),
            "nbytes": int(buf.numel()), "byte_offset": int(buf.storage_offset())}


def _local_device(torch: Any, info: dict[str, Any]) -> int:
    uuid = info.get("uuid")
    if uuid is None:
        return int(info["device"])
    for i in range(torch.cuda.device_count()):
        if _uuid(torch, i) == uuid:
            return i
    raise Unsupported(f"the daemon's GPU ({uuid}) is not visible to this process "
                      "(CUDA_VISIBLE_DEVICES): CUDA IPC maps memory of a device this process sees")


def open_buffer(info: dict[str, Any]) -> Any:
    """The exporter's buffer mapped here: a CUDA uint8 tensor of ``info["nbytes"]`` bytes."""
    torch = require_cuda()
    torch.cuda._lazy_init()  # as torch.multiprocessing's rebuild_cuda_tensor does first
    device = _local_device(torch, info)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device, _unhex(info["handle"]), info["storage_size"], info["storage_offset"],
            _unhex(info["ref_counter"]), info["ref_offset"], _unhex(info["event"]),
            info["event_sync"])
    except (RuntimeError, TypeError) as e:  # cudaIpcOpenMemHandle refused (some VMs, MIG)
        raise Unsupported(f"cannot map the daemon's GPU memory over CUDA IPC: {e}") from None
    t = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    return t.set_(storage, info["byte_offset"], (info["nbytes"],), (1,))
