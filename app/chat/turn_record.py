"""What one turn leaves in the history database, and when it is written. No Qt.

A turn the engine refuses (too long for the context, over the budget) leaves nothing: the user's
message is written only once the engine has accepted the turn, together with the reply's first
text, in one transaction. The reply is then saved as it grows (at most every SAVE_INTERVAL_S), in
state "streaming", so a crash keeps what was shown; HistoryStore marks such a row "interrupted"
when it is next opened.
"""
from __future__ import annotations

import time

from kvchat.engine.events import TurnFinished

from kvchat.app.store.history import DONE, INTERRUPTED, STREAMING, HistoryStore

SAVE_INTERVAL_S = 0.5
REFUSED_REASONS = ("context", "budget", "unreachable")    # unreachable: a remote server that did not answer


def is_refused(event: TurnFinished) -> bool:
    """The engine turned the message away: no reply (nor reasoning), and a reason that is about size (or no
    server)."""
    return not event.text and not event.reasoning and event.finish_reason in REFUSED_REASONS


def stopped_before_reply(turn, event: TurnFinished) -> bool:
    """The turn was stopped (by Stop, or by closing the app) before any of its reply came, and an empty reply stands
    saved for it: the chat shows that reply marked, to regenerate or edit (chat_view's NO_REPLY_MARK)."""
    if event.text or event.reasoning or event.finish_reason != "stopped":
        return False
    if isinstance(turn, TurnRecord):
        return turn.saved
    return isinstance(turn, ReplyRecord) and turn.kind == "regenerate" and not turn._versioned


class TurnRecord:
    def __init__(self, history: HistoryStore, conversation_id: int, user_text: str, new_conversation: bool,
                 clock=time.monotonic, model: str | None = None):
        self.history = history
        self.model = model                              # the loaded model's name, stored as the reply's author
        self.conversation_id = conversation_id
        self.user_text = user_text
        self.new_conversation = new_conversation        # created for this turn: removed again if it is refused
        self._clock = clock
        self._reply_id: int | None = None
        self.user_id: int | None = None
        self._text = ""
        self._reasoning = ""                            # the reply's reasoning (a model that reasons apart)
        self._saved_at = 0.0

    @property
    def saved(self) -> bool:
        return self._reply_id is not None

    @property
    def reply_id(self) -> int | None:
        return self._reply_id

    def delta(self, text: str, reasoning: str = "") -> None:
        """More reply text (or reasoning): written now if the last save is SAVE_INTERVAL_S old (the first piece at
        once)."""
        self._text += text
        self._reasoning += reasoning
        now = self._clock()
        if self._reply_id is None:
            self.user_id, self._reply_id = self.history.add_turn(self.conversation_id, [
                ("user", self.user_text, DONE), ("assistant", self._text, STREAMING)], self.model, self._reasoning)
            self._saved_at = now
        elif now - self._saved_at >= SAVE_INTERVAL_S:
            self.history.update_message(self._reply_id, self._text, STREAMING, reasoning=self._reasoning)
            self._saved_at = now

    def finish(self, event: TurnFinished) -> bool:
        """Write the turn's end; False when the engine refused it (nothing of it stays in the database)."""
        if self._reply_id is None:
            if is_refused(event):
                if self.new_conversation and not self.history.messages(self.conversation_id):
                    self.history.delete(self.conversation_id)
                return False
            self.user_id, self._reply_id = self.history.add_turn(self.conversation_id, [
                ("user", self.user_text, DONE), ("assistant", event.text, DONE)], self.model, event.reasoning)
            self.history.update_message(self._reply_id, event.text, DONE, event.finish_reason)
            return True
        self.history.update_message(self._reply_id, event.text or self._text, DONE, event.finish_reason,
                                    reasoning=event.reasoning or self._reasoning)
        return True

    def fail(self) -> None:
        """The turn ended in an exception: a partial reply stays, marked interrupted."""
        if self._reply_id is not None:
            self.history.update_message(self._reply_id, self._text, INTERRUPTED, reasoning=self._reasoning)
        elif self.new_conversation and not self.history.messages(self.conversation_id):
            self.history.delete(self.conversation_id)


class ReplyRecord:
    """A reply written again in place: a regenerate (a new version of the message) or a Continue (its text grows).

    The message row holds the reply as it streams (state "streaming"); at the end a regenerate adds a
    version (the old reply stays one), a Continue updates the chosen version. An empty reply (stopped before
    any of it came) is no version: a regenerate writes over it."""

    new_conversation = False

    def __init__(self, history: HistoryStore, conversation_id: int, message_id: int, kind: str, before: str,
                 clock=time.monotonic, model: str | None = None, before_reasoning: str = ""):
        assert kind in ("regenerate", "continue")
        self.history = history
        self.model = model              # a regenerate's author; a Continue keeps the reply's first author
        self.conversation_id = conversation_id
        self.message_id = message_id
        self.kind = kind
        self.user_text = ""
        self._before = before                   # the reply's text before this turn (kept when nothing comes)
        self._before_reasoning = before_reasoning
        self._text = before if kind == "continue" else ""
        self._reasoning = before_reasoning if kind == "continue" else ""
        self._clock = clock
        self._saved_at = clock()
        self._chosen = history.chosen_version(message_id)
        self._versioned = kind == "regenerate" and bool(before or before_reasoning)
        if self._versioned:
            history.keep_as_version(message_id)     # before the row starts holding the new reply

    @property
    def reply_id(self) -> int:
        return self.message_id

    def delta(self, text: str, reasoning: str = "") -> None:
        self._text += text
        self._reasoning += reasoning
        now = self._clock()
        if now - self._saved_at >= SAVE_INTERVAL_S:
            self.history.update_message(self.message_id, self._text, STREAMING, reasoning=self._reasoning)
            self._saved_at = now

    def finish(self, event: TurnFinished) -> bool:
        came = event.text or event.reasoning or self.kind == "regenerate"
        text = event.text if came else self._text
        reasoning = event.reasoning if came else self._reasoning
        if self._versioned:
            self.history.add_version(self.message_id, text, event.finish_reason, self.model, reasoning)
        else:
            author = self.model if self.kind == "regenerate" else None
            self.history.update_message(self.message_id, text, DONE, event.finish_reason, author, reasoning)
            self.history.update_version(self.message_id, text, event.finish_reason, reasoning)
        return True

    def fail(self) -> None:
        """An exception mid-way: a regenerate goes back to the reply it replaced; a Continue keeps what came."""
        if self._versioned:
            self.history.choose_version(self.message_id, self._chosen)
        elif self.kind == "regenerate":
            self.history.update_message(self.message_id, self._before, DONE, reasoning=self._before_reasoning)
        else:
            self.history.update_message(self.message_id, self._text, DONE, reasoning=self._reasoning)
