"""Process memory probes: RSS (psutil), torch's CUDA allocator, and the GPU as the driver sees it."""
from __future__ import annotations

import os

import torch

from kvchat.engine.events import MemoryProbe

_nvml_handle = None
_nvml_failed = False


def _nvml():
    global _nvml_handle, _nvml_failed
    if _nvml_handle is None and not _nvml_failed and torch.cuda.is_available():
        try:
            import pynvml
            pynvml.nvmlInit()
            _nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            _nvml_failed = True
    return _nvml_handle


def _allocated() -> int:
    """Bytes torch's CUDA allocator has handed out (0 without CUDA)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def release_cached(device) -> None:
    """Give the CUDA allocator's cached, unused blocks back to the driver (after a reset or a cleared prefix cache),
    so NVML's figure drops with the pool's; nothing to do on the CPU (plan.fit.trim_heap does that part)."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def probe() -> MemoryProbe:
    import psutil             # here, not at import: 40-90 ms off every start, paid once the first turn ends
    rss = psutil.Process(os.getpid()).memory_info().rss
    allocated = _allocated()
    used = total = 0
    handle = _nvml()
    if handle is not None:
        import pynvml
        try:
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    used = proc.usedGpuMemory
        except Exception:
            pass
    return MemoryProbe(rss, allocated, used, total)
