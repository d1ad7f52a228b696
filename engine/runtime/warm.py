"""Warm conversations: a session's KV cache saved to the user cache dir and restored instead of read again.

`WarmStore` is the folder of saved caches with its disk budget (least recently used first out). `save` writes a
session's cache (engine/kv/saved.py: its blocks as stored, its token ids, the identity of the model file, the
layout, the format version); `restore` reads it back into an empty session whose messages are the same
conversation, or raises CacheFileError saying why not (the caller reads the text again, losing nothing).
`offload` and `sync` are the second tier: a conversation the budget releases keeps its cache in host memory or its
file, and reads it back on its next turn. All of them write the session's SessionState, never its private fields.
"""
from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.engine.kv import saved
from kvchat.engine.kv.layout import MIB
from kvchat.engine.config import ConfigError
from kvchat.engine.kv.saved import CacheFileError, NoSavedCache
from kvchat.engine.text.chat_format import held_prefix

__all__ = ["CacheFileError", "NoSavedCache", "Restored", "WarmStore", "model_identity", "restore", "save"]

DEFAULT_DISK_BUDGET_MB = 2048
RELEASED_NOTICE = "This conversation's cache was released to make room for another; its history is read again."
SUFFIX = ".kvcache"
_READ_SLACK = 64 * MIB           # a file may exceed the KV budget by its token ids, logits and header
LEFTOVER_AGE_S = 3600            # a save's temporary file this old belongs to a process that ended mid-write


def model_identity(path: Path, is_gguf: bool) -> dict:
    """What produced a cache: the model file's name, size, mtime and a SHA-256 of its header and tensor index
    (a GGUF's bytes before the tensor data; a folder's config.json and each safetensors header)."""
    path = Path(path)
    h = hashlib.sha256()
    if is_gguf:
        from kvchat.engine.gguf.file import GGUFFile
        start = GGUFFile(path).data_start
        with open(path, "rb") as f:
            h.update(f.read(start))
        st = path.stat()
        size, mtime = st.st_size, int(st.st_mtime)
    else:
        size = mtime = 0
        for f in sorted([path / "config.json", *path.glob("*.safetensors")]):
            st = f.stat()
            size, mtime = size + st.st_size, max(mtime, int(st.st_mtime))
            with open(f, "rb") as fh:
                if f.suffix == ".safetensors":
                    n = int.from_bytes(fh.read(8), "little")
                    h.update(fh.read(min(n, 100 * MIB)))
                else:
                    h.update(fh.read())
    return {"name": path.name, "size": size, "mtime": mtime, "header_sha256": h.hexdigest()}


@dataclass(frozen=True)
class Restored:
    tokens: int              # tokens the cache holds again
    seconds: float
    file_bytes: int


def save(session, path: Path, identity: dict) -> int:
    """The session's cache into `path` (atomically); returns the file's bytes, 0 when it holds nothing (a file saved
    before stays: a chat released to it, or reopened and not yet restored, holds nothing in the pool)."""
    runner, state = session.runner, session.state
    with runner.lock:
        if not state.num_cached:
            return 0
        groups, tensors = runner.export_kv(state.seq)
        tensors["token_ids"] = torch.tensor(state.token_ids, dtype=torch.int64)
        if state.prompt_logits is not None:
            tensors["prompt_logits"] = state.prompt_logits.detach().float().cpu().reshape(-1).contiguous()
        meta = {"model": identity, "groups": groups, "prompt_end": state.prompt_end,
                "starts": list(state.starts), "messages": len(session.messages),
                "cache": session.cache_config.label()}
    return saved.write(path, meta, tensors)


def restore(session, path: Path, identity: dict) -> Restored:
    """Read a saved cache into `session` (holding nothing, its messages the saved conversation's or more);
    CacheFileError says why it cannot be, and leaves the session as it was."""
    started = time.perf_counter()
    runner, state = session.runner, session.state
    if state.num_cached or state.token_ids:
        raise CacheFileError("the conversation already holds a cache")
    meta, tensors = saved.read(path, runner.budget_bytes + _READ_SLACK)
    saved_with = meta.get("model")
    if saved_with != identity:
        rope = isinstance(saved_with, dict) and {**saved_with, "longrope": 0} == {**identity, "longrope": 0}
        raise CacheFileError("the cache was saved with the model's other LongRoPE factors (another cache budget "
                             "chose them)" if rope else "the cache was saved with another model file (or the file "
                             "changed since)")
    ids_t = tensors.get("token_ids")
    if ids_t is None or ids_t.dtype != torch.int64 or ids_t.dim() != 1:
        raise CacheFileError("the saved cache has no token ids: the file is damaged")
    ids = ids_t.tolist()
    vocab = runner.config.vocab_size
    groups = meta.get("groups")
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], dict):
        raise CacheFileError("the saved cache's group description is damaged")
    held = groups[0].get("num_tokens")
    if not ids or any(not 0 <= t < vocab for t in ids) or not isinstance(held, int) or not 0 < held <= len(ids):
        raise CacheFileError("the saved cache's token ids do not fit this model: the file is damaged")
    if any(isinstance(g, dict) and g.get("num_tokens") != held for g in groups):
        raise CacheFileError("the saved cache's groups hold different tokens: the file is damaged")
    logits = tensors.get("prompt_logits")
    if logits is not None and (logits.dtype != torch.float32 or tuple(logits.shape) != (vocab,)):
        raise CacheFileError("the saved cache's logits do not fit this model: the file is damaged")
    if logits is not None and not bool(torch.isfinite(logits).all()):
        raise CacheFileError("the saved cache's logits are not finite (NaN or inf): the file is damaged")
    starts = meta.get("starts")
    if not (isinstance(starts, list) and len(starts) == len(session.messages)
            and all(s is None or (isinstance(s, int) and 0 <= s <= len(ids)) for s in starts)):
        starts = None
    reply_start = starts[-1] if starts and session.messages[-1]["role"] == "assistant" else None
    kept = _check_text(session, ids, held, reply_start)
    runner.import_kv(state.seq, groups, tensors, extra={"token_ids", "prompt_logits"})
    if kept < held:         # the format writes the last reply otherwise (Harmony drops its analysis): cut back to it
        try:
            runner.truncate(state.seq, held - kept)
        except ConfigError:
            runner.free(state.seq)
            raise CacheFileError("the saved cache cannot be cut back to where the last reply began") from None
        ids, held = ids[:kept], kept
    state.token_ids = ids
    end = meta.get("prompt_end")
    state.prompt_end = end if isinstance(end, int) and 0 <= end <= len(ids) else len(ids)
    if starts is not None:
        state.starts = list(starts)
    # the logits a regenerate starts from, where the conversation is exactly as saved (its last reply included)
    same = meta.get("messages") == len(session.messages) and logits is not None
    state.prompt_logits = logits.to(runner.device) if same else None
    return Restored(held, time.perf_counter() - started, Path(path).stat().st_size)


def _check_text(session, ids: list[int], cached: int, reply_start: int | None = None) -> int:
    """The saved tokens must read as the start of the conversation as it is now (an edit in between: read again);
    returns how many of the cached ones are kept (those before the last reply where the format writes it otherwise
    than the model did: chat_format.held_prefix)."""
    if not session.messages:          # tokens fed through append: they are the conversation
        return cached
    rendered, _ = session.encode_conversation(session.messages)
    held = held_prefix(session.tokenizer, rendered, ids, cached, reply_start)
    if held is None:
        raise CacheFileError("the conversation changed since its cache was saved")
    return min(held[0], cached)


def sync(session) -> None:
    """A conversation whose cache was released for another holds nothing: its saved cache is read back where it has
    one (host memory or its file: the second tier), else its tokens are read again on this turn (the notice says
    which)."""
    state = session.state
    state.seq.released = False
    ids, kept = list(state.token_ids), state.kept_turn()
    state.token_ids.clear()
    state.forget_prompt()
    if state.tier == "host":
        state.notice = _from_host(session, ids, kept)
    elif session.warm is not None and state.tier == "disk":
        state.notice = _read_back(session, ids, kept)
    else:
        state.notice = RELEASED_NOTICE


def offload(session) -> bool:
    """The budget is releasing this idle conversation: its cache goes to the second tier first, host memory when the
    pool is on a GPU (runner.host_tier), else (or when that is full) its saved file. True when it was kept."""
    state = session.state
    if _to_host(session):
        state.tier = "host"
        return True
    store, key, identity = session.warm
    kept = store.save(session, key, identity) > 0
    state.tier = "disk" if kept else "none"
    return kept


def _read_back(session, ids: list[int], kept: tuple) -> str:
    """A conversation the budget released to its saved file reads it back; returns the notice for the user.
    Anything but the same tokens leaves it empty (read again)."""
    store, key, identity = session.warm
    state = session.state
    try:
        got = store.restore(session, key, identity)
    except CacheFileError as exc:
        state.tier = "none"
        return (f"This conversation's cache was released to make room for another and could not be read back "
                f"({exc}); its history is read again.")
    if state.token_ids != ids:           # saved before its last turn: not what the chat holds now
        session.runner.free(state.seq)
        state.token_ids.clear()
        state.forget_prompt()
        state.tier = "none"
        return RELEASED_NOTICE
    state.tier = "pool"
    state.resume_turn(*kept)
    return (f"This conversation's cache was read back from disk ({got.tokens:,} tokens, {got.seconds:.1f} s) "
            f"after it was released to make room for another.")


def host_key(session) -> str:
    return f"conversation-{id(session)}"


def _to_host(session) -> bool:
    """The second tier of a GPU pool: a released conversation's cache exported as stored into pinned host memory
    (runner.host_tier, within its budget). False where there is no such tier, or no room in it."""
    tier, seq = session.runner.host_tier, session.state.seq
    if tier is None or not seq.num_tokens:
        return False
    groups, tensors = session.runner.export_kv(seq)
    return tier.put(host_key(session), groups, tensors, seq.num_tokens)


def _from_host(session, ids: list[int], kept: tuple) -> str:
    """A conversation released to host memory reads its cache back; returns the notice. A copy that cannot come back
    (no room in the pool now) leaves it empty: its history is read again."""
    t0 = time.perf_counter()
    state = session.state
    copy = session.runner.host_tier.take(host_key(session))
    state.tier = "none"
    if copy is None:
        return RELEASED_NOTICE
    tokens, groups, tensors = copy
    if tokens > len(ids):
        return RELEASED_NOTICE
    try:
        session.runner.import_kv(state.seq, groups, tensors)
    except CacheFileError as exc:
        return (f"This conversation's cache was released to make room for another and could not be read back from "
                f"host memory ({exc}); its history is read again.")
    state.token_ids[:] = ids
    state.tier = "pool"
    state.resume_turn(*kept)
    return (f"This conversation's cache was read back from host memory ({tokens:,} tokens, "
            f"{time.perf_counter() - t0:.2f} s) after it was released to make room for another.")


_KEY = re.compile(r"[^A-Za-z0-9_.]")


class WarmStore:
    """The folder of saved caches (the user cache dir's kv/), within a disk budget: the least recently used
    file goes first when a new one needs room; a restore counts as a use."""

    def __init__(self, folder: Path, budget_mb: float = DEFAULT_DISK_BUDGET_MB):
        self.folder = Path(folder)
        self.budget_bytes = int(budget_mb * MIB)
        self._totals: tuple[float, tuple] | None = None      # (when counted, ((key, bytes), ...) newest first)

    def entries(self, max_age_s: float = 2.0) -> tuple[tuple[str, int, str], ...]:
        """(conversation key, bytes, model tag) of every saved cache, the most recently used first (the tag: the
        start of the model's header hash, as `path` names it); counted at most every max_age_s (stats ask ~10 times
        a second)."""
        now = time.monotonic()
        if self._totals is None or now - self._totals[0] > max_age_s:
            files = sorted(self.files(), key=_mtime, reverse=True)
            self._totals = (now, tuple((*p.name[:-len(SUFFIX)].rsplit("-", 1), _size(p)) for p in files
                                       if "-" in p.name))
        return tuple((key, size, model) for key, model, size in self._totals[1])

    def totals(self, max_age_s: float = 2.0) -> tuple[int, int]:
        """(files, bytes) saved (see entries)."""
        entries = self.entries(max_age_s)
        return len(entries), sum(b for _, b, _ in entries)

    def path(self, key: str, identity: dict) -> Path:
        """The file of one conversation (key: its id in the app's history) for one model."""
        model = identity.get("header_sha256", "")[:12]
        return self.folder / f"{_KEY.sub('_', str(key))[:64]}-{model}{SUFFIX}"

    def files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return [p for p in self.folder.iterdir() if p.name.endswith(SUFFIX) and p.is_file()]

    def total_bytes(self) -> int:
        return sum(_size(p) for p in self.files())

    def save(self, session, key: str, identity: dict) -> int:
        """Write the session's cache; then drop the least recently used files until the folder fits its budget
        (this one last: a cache larger than the whole budget is not kept). Returns the bytes kept (0: none)."""
        path = self.path(key, identity)
        written = save(session, path, identity)
        self._totals = None
        if not written:
            return 0
        if written > self.budget_bytes:
            path.unlink(missing_ok=True)
            return 0
        self.trim(keep=path)
        return written if path.exists() else 0

    def restore(self, session, key: str, identity: dict) -> Restored:
        path = self.path(key, identity)
        result = restore(session, path, identity)
        try:
            os.utime(path)              # used now: the last to go
        except OSError:
            pass
        return result

    def trim(self, keep: Path | None = None) -> int:
        """Delete least recently used files until the total fits the budget; returns the bytes deleted. A save's
        temporary file left by a process that ended mid-write (an app closed past its deadline) goes too."""
        self._totals = None
        self._remove_leftovers()
        files = sorted(self.files(), key=_mtime)
        total, deleted = sum(map(_size, files)), 0
        for p in files:
            if total <= self.budget_bytes:
                break
            if p == keep:
                continue
            size = _size(p)
            p.unlink(missing_ok=True)
            total, deleted = total - size, deleted + size
        return deleted

    def _remove_leftovers(self) -> None:
        if not self.folder.is_dir():
            return
        old = time.time() - LEFTOVER_AGE_S     # younger ones may be another process's save in progress
        for p in self.folder.glob(f"*{SUFFIX}.*.tmp"):
            if p.is_file() and _mtime(p) < old:
                p.unlink(missing_ok=True)

    def delete(self, key: str) -> int:
        """Every saved cache of one conversation (any model); returns the bytes deleted."""
        prefix = _KEY.sub("_", str(key))[:64] + "-"
        self._totals = None
        gone = 0
        for p in self.files():
            if p.name.startswith(prefix):
                gone += _size(p)
                p.unlink(missing_ok=True)
        return gone

    def clear(self) -> int:
        self._totals = None
        gone = 0
        for p in self.files():
            gone += _size(p)
            p.unlink(missing_ok=True)
        return gone


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return 0.0
