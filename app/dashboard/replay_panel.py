"""The Attention page's replay row: "Replay with…" the open chat under another cache mode, its progress with a
Cancel, and what it found per reply (top-1 agreement, KL, the first token the mode would have chosen otherwise).

A link per reply jumps to it in the chat; AttentionController (attention_controller.py) runs the replay through the
engine host and marks the replies in the chat.
"""
from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QSizePolicy, QVBoxLayout, QWidget

from kvchat.app.bridge.attention_events import ReplayShown
from kvchat.app.engine_text import engine_text
from kvchat.app.i18n import cache_label

MESSAGE_LINK = "message:"


class ReplayPanel(QWidget):
    replay_requested = Signal()
    cancel_requested = Signal()
    message_clicked = Signal(int)       # a session message index

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("replayPanel")
        self.state = "idle"             # idle, running, shown, failed, cancelled
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        row = QHBoxLayout()
        self.status = QLabel(self.tr("Replay: how this chat would have gone under another cache mode (the chat is "
                                     "not changed)."), objectName="replayStatus", wordWrap=True)
        self.status.setTextFormat(Qt.TextFormat.RichText)
        self.status.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.button = QPushButton(self.tr("Replay with…"), objectName="replayButton")
        self.button.setToolTip(self.tr("Read this chat again under another cache mode beside its own, and see where "
                                       "the replies would have gone otherwise"))
        self.button.clicked.connect(self.replay_requested)
        row.addWidget(self.status, 1)
        row.addWidget(self.button, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(row)
        progress_row = QHBoxLayout()
        self.progress = QProgressBar(objectName="replayProgress", textVisible=True)
        self.cancel_button = QPushButton(self.tr("Cancel"), objectName="replayCancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.cancel_button)
        layout.addLayout(progress_row)
        self.results = QLabel("", objectName="replayResults", wordWrap=True)
        self.results.setTextFormat(Qt.TextFormat.RichText)
        self.results.linkActivated.connect(self._link)
        layout.addWidget(self.results)
        self._running(False)
        self.results.setVisible(False)

    def _running(self, running: bool) -> None:
        for widget in (self.progress, self.cancel_button):
            widget.setVisible(running)
        self.button.setEnabled(not running)

    def set_available(self, available: bool, why: str = "") -> None:
        """A remote server, or an engine that cannot replay: the button goes, and the line says why."""
        self.button.setVisible(available)
        if not available and self.state != "running":
            self.status.setText(html.escape(why))

    def started(self, mode) -> None:
        self.state = "running"
        self.status.setText(self.tr("Replaying this chat under <b>{mode}</b>…").format(
            mode=html.escape(cache_label(mode))))
        self.progress.setRange(0, 0)
        self._running(True)

    def show_progress(self, done: int, total: int) -> None:
        if self.state != "running":
            return
        self.progress.setRange(0, max(1, total))
        self.progress.setValue(min(done, total))
        self.progress.setFormat(self.tr("{done} of {total} tokens").format(done=f"{done:,}", total=f"{total:,}"))

    def failed(self, error: str, cancelled: bool) -> None:
        self.state = "cancelled" if cancelled else "failed"
        self._running(False)
        self.status.setText(self.tr("Replay stopped: nothing was measured.") if cancelled else
                            self.tr("Replay not run: {error}").format(error=html.escape(engine_text(error))))

    def shown(self, result: ReplayShown) -> None:
        self.state = "shown"
        self._running(False)
        mode, baseline = html.escape(cache_label(result.mode)), html.escape(cache_label(result.baseline))
        first = self.tr("no token chosen otherwise") if result.first_divergence is None else \
            self.tr("first other choice at token {n}").format(n=f"{result.first_divergence:,}")
        self.status.setText(self.tr(
            "<b>{mode}</b> against this chat's <b>{baseline}</b> over {tokens} tokens: top-1 agreement "
            "<b>{top1}</b> · KL {kl} nats/token · {first} <span style='color:#6b7280'>({seconds} s)</span>").format(
            mode=mode, baseline=baseline, tokens=f"{result.tokens:,}", top1=f"{result.top1:.1%}",
            kl=f"{result.kl:.4f}", first=first, seconds=f"{result.seconds:.1f}"))
        reply_head, top1_head, other_head = self.tr("Reply"), self.tr("top-1"), self.tr("First other choice")
        rows = [f"<tr><th align='left'>{reply_head}</th><th align='right'>{top1_head}</th>"
                f"<th align='right'>KL</th><th align='left'>{other_head}</th></tr>"]
        for number, reply in enumerate(result.replies, 1):
            name = self.tr("reply {n}").format(n=number)
            link = f"<a href='{MESSAGE_LINK}{reply.index}'>{name}</a>"
            if reply.first_divergence is None:
                where = self.tr("none")
            else:
                where = self.tr("token {n}: «{expected}» → «{replayed}»").format(
                    n=f"{reply.first_divergence - reply.start:,}", expected=html.escape(reply.expected),
                    replayed=html.escape(reply.replayed))
            rows.append(f"<tr><td>{link}</td><td align='right'>{reply.top1:.1%}</td>"
                        f"<td align='right'>{reply.kl:.4f}</td><td>{where}</td></tr>")
        self.results.setText("<table cellspacing='0' cellpadding='2'>" + "".join(rows) + "</table>")
        self.results.setVisible(True)

    def _link(self, url: str) -> None:
        if url.startswith(MESSAGE_LINK):
            self.message_clicked.emit(int(url[len(MESSAGE_LINK):]))
