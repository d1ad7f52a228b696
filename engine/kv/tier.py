"""The second tier for preempted requests: their KV kept aside and read back, instead of read again.

When the scheduler must preempt a request for room, its cache is exported as stored (engine/kv/saved.py: the
blocks of every group, scales, zero points, the full-precision head and tail) into the tier, and the blocks go
back to the pool. When the request is admitted again, the tier imports those bytes under new block ids and the
request goes on from the token it had reached: the same bits as a request that never left the pool, and no
prompt pass (vLLM's swap preemption, beside its recompute one).

Where the pool is on a GPU the tier is host memory (pinned, so the copy back is a DMA the GPU runs on its own);
where the pool is already host memory, keeping a copy in RAM would only move the budget, so the tier is files
in a private temporary folder (safetensors with a checksum, as saved conversations are). The tier has a byte
budget; a request that does not fit it, or whose copy cannot be read back, is recomputed as before.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.engine.kv import saved
from kvchat.engine.kv.layout import MIB

log = logging.getLogger("kvchat.serve")
DEFAULT_TIER_MB = 2048


@dataclass
class _Kept:
    num_tokens: int
    nbytes: int
    groups: list
    tensors: dict | None = None      # host tier
    path: Path | None = None         # file tier


class PreemptTier:
    """Preempted requests' caches by request id, within budget_bytes (0: the tier is off, preemption recomputes)."""

    def __init__(self, budget_mb: float = DEFAULT_TIER_MB, where: str = "disk"):
        if where not in ("host", "disk"):
            raise ValueError(f"tier {where!r}: host or disk")
        self.budget_bytes = max(0, int(budget_mb * MIB))
        self.where = where
        self._kept: dict[str, _Kept] = {}
        self._folder: Path | None = None
        self._lock = threading.Lock()
        self.num_kept = self.num_resumed = self.num_recomputed = 0
        self.tokens_resumed = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(k.nbytes for k in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, request_id: str, groups: list, tensors: dict[str, torch.Tensor], num_tokens: int) -> bool:
        """Keep one request's exported cache; False when it does not fit the budget (it is then recomputed)."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if not num_tokens or size > self.budget_bytes - self.nbytes:
            return False
        kept = _Kept(num_tokens, size, groups)
        if self.where == "host":
            pin = torch.cuda.is_available()
            kept.tensors = {name: t.pin_memory() if pin else t for name, t in tensors.items()}
        else:
            try:
                kept.path = self._dir() / f"{request_id}.kvcache"
                kept.nbytes = saved.write(kept.path, {"groups": groups, "num_tokens": num_tokens}, tensors)
            except OSError as exc:
                log.warning("could not keep %s's cache on disk (%s): it will be read again", request_id, exc)
                return False
        with self._lock:
            self._kept[request_id] = kept
        self.num_kept += 1
        return True

    def bytes_of(self, request_id: str) -> int:
        """Bytes a kept request's cache holds (0: none kept)."""
        with self._lock:
            kept = self._kept.get(request_id)
        return kept.nbytes if kept is not None else 0

    def take(self, request_id: str) -> tuple[int, list, dict] | None:
        """(tokens, groups, tensors) of a kept request, removed from the tier; None when there is none or its copy
        cannot be read back (a damaged file: the request is recomputed)."""
        with self._lock:
            kept = self._kept.pop(request_id, None)
        if kept is None:
            return None
        if kept.tensors is not None:
            return kept.num_tokens, kept.groups, kept.tensors
        try:
            meta, tensors = saved.read(kept.path, kept.nbytes + MIB)
        except saved.CacheFileError as exc:
            log.warning("the kept cache of %s could not be read back (%s): it is read again", request_id, exc)
            return None
        finally:
            kept.path.unlink(missing_ok=True)
        if meta.get("groups") != kept.groups or meta.get("num_tokens") != kept.num_tokens:
            return None
        return kept.num_tokens, kept.groups, tensors

    def drop(self, request_id: str) -> None:
        """Forget a request's copy (it finished or was aborted while waiting)."""
        with self._lock:
            kept = self._kept.pop(request_id, None)
        if kept is not None and kept.path is not None:
            kept.path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._kept.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _dir(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="kvchat-preempted-"))     # 0700, removed at close
            weakref.finalize(self, shutil.rmtree, self._folder, True)          # or when the tier goes
        return self._folder
