"""What the window asks of the engine thread: one frozen dataclass per command.

EngineHost sends each through one queued signal and EngineWorker runs it from one table (worker.HANDLERS), so a
new command is a dataclass here and a row there. Each says how it treats a running quality measurement and a
pressed Stop, because those two flags are set from the GUI thread before the command is queued: a Stop pressed
before a turn starts must still count, and a measurement must yield to whatever the user asked for next.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from kvchat.engine.config import CacheConfig, SamplingParams

Pairs = tuple[tuple[str, str], ...]     # a chat's messages as (role, content): no dicts cross the thread


@dataclass(frozen=True, slots=True)
class Command:
    # True: a running measurement yields to this command; False: this command starts one; None: leaves it alone
    cancel_measure: ClassVar[bool | None] = True
    starts_turn: ClassVar[bool] = False      # clears a Stop left from the last turn

    def args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True, slots=True)
class Load(Command):
    config: object                      # EngineConfig, or RemoteSettings for a server


@dataclass(frozen=True, slots=True)
class OpenSession(Command):
    conversation_id: int | None
    system_prompt: str | None
    cache: CacheConfig | None
    history: Pairs


@dataclass(frozen=True, slots=True)
class Adopt(Command):
    cancel_measure: ClassVar[bool | None] = None
    conversation_id: int


@dataclass(frozen=True, slots=True)
class Send(Command):
    starts_turn: ClassVar[bool] = True
    text: str
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Regenerate(Command):
    starts_turn: ClassVar[bool] = True
    sampling: SamplingParams
    history: Pairs | None               # the chat as shown; None: as the session holds it


@dataclass(frozen=True, slots=True)
class ContinueReply(Command):
    starts_turn: ClassVar[bool] = True
    sampling: SamplingParams
    history: Pairs | None


@dataclass(frozen=True, slots=True)
class EditResend(Command):
    starts_turn: ClassVar[bool] = True
    history: Pairs                      # the messages before the edited one
    text: str
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class SyncHistory(Command):
    history: Pairs


@dataclass(frozen=True, slots=True)
class SetCache(Command):
    cache: CacheConfig


@dataclass(frozen=True, slots=True)
class Reset(Command):
    pass


@dataclass(frozen=True, slots=True)
class ClearPrefixCache(Command):
    pass


@dataclass(frozen=True, slots=True)
class PollStats(Command):
    cancel_measure: ClassVar[bool | None] = None


@dataclass(frozen=True, slots=True)
class MeasureQuality(Command):
    cancel_measure: ClassVar[bool | None] = False
    cache: CacheConfig


@dataclass(frozen=True, slots=True)
class ReplayChat(Command):
    cancel_measure: ClassVar[bool | None] = False    # it runs under the measurement flag: any later command stops it
    mode: CacheConfig                   # the open chat teacher-forced through this mode beside its own


@dataclass(frozen=True, slots=True)
class CountTokens(Command):
    cancel_measure: ClassVar[bool | None] = None
    requests: tuple                     # ((conversation id, system prompt, Pairs), ...)


@dataclass(frozen=True, slots=True)
class CountMessage(Command):
    text: str
    history: Pairs


@dataclass(frozen=True, slots=True)
class ForgetCache(Command):
    cancel_measure: ClassVar[bool | None] = None
    conversation_id: int


@dataclass(frozen=True, slots=True)
class SetDiskBudget(Command):
    cancel_measure: ClassVar[bool | None] = None
    mb: float


@dataclass(frozen=True, slots=True)
class CountSavedCaches(Command):
    cancel_measure: ClassVar[bool | None] = None     # Settings opening asks: a measurement keeps running


@dataclass(frozen=True, slots=True)
class DeleteSavedCaches(Command):
    pass                                # the user confirmed: every chat's saved cache, of every model


@dataclass(frozen=True, slots=True)
class SetSpeculative(Command):
    cancel_measure: ClassVar[bool | None] = None
    method: str
    k: int


@dataclass(frozen=True, slots=True)
class SetPrefill(Command):
    cancel_measure: ClassVar[bool | None] = None
    mode: str                           # one of engine.config.PREFILL_MODES


@dataclass(frozen=True, slots=True)
class SetActivations(Command):
    cancel_measure: ClassVar[bool | None] = None
    mode: str                           # one of engine.config.ACTIVATION_MODES


@dataclass(frozen=True, slots=True)
class Close(Command):
    deadline: float                     # time.monotonic(): no chat's cache starts saving after it


def pairs(history: list[dict] | None) -> Pairs | None:
    return None if history is None else tuple((m["role"], m["content"]) for m in history)

