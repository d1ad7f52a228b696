"""The dashboard's Server section: what a remote OpenAI-compatible server reports about itself.

KV usage, running and waiting requests and the prefix-cache hit rate come from the server's /metrics
(vLLM's names; kvchat serve uses the same); tokens/s and time to first token are measured here, from
the stream. A number the server does not publish says so instead of showing 0.
"""
from __future__ import annotations

import html

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication
from PySide6.QtWidgets import QFormLayout, QLabel, QVBoxLayout, QWidget

from kvchat.engine.events import StatsSnapshot

UNAVAILABLE_REMOTE = QT_TRANSLATE_NOOP("ServerPanel", "not available for a remote server")
NOT_REPORTED = QT_TRANSLATE_NOOP("ServerPanel", "not reported by this server")


def unavailable_remote() -> str:
    """UNAVAILABLE_REMOTE in the interface language."""
    return QCoreApplication.translate("ServerPanel", UNAVAILABLE_REMOTE)


class ServerPanel(QWidget):
    FIELDS = (("kv_usage", QT_TRANSLATE_NOOP("ServerPanel", "KV cache usage")),
              ("running", QT_TRANSLATE_NOOP("ServerPanel", "Requests running")),
              ("waiting", QT_TRANSLATE_NOOP("ServerPanel", "Requests waiting")),
              ("prefix", QT_TRANSLATE_NOOP("ServerPanel", "Prefix-cache hit rate")),
              ("spec", QT_TRANSLATE_NOOP("ServerPanel", "Speculative decoding")),
              ("decode", QT_TRANSLATE_NOOP("ServerPanel", "Decode speed (this chat)")),
              ("ttft", QT_TRANSLATE_NOOP("ServerPanel", "Time to first token (this chat)")))

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("serverPanel")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        self.title = QLabel(self.tr("Server"), objectName="dashboardSection")
        layout.addWidget(self.title)
        self.source = QLabel("", objectName="plotLegend")
        self.source.setWordWrap(True)
        layout.addWidget(self.source)
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.setVerticalSpacing(1)
        # in a narrow dock a value goes under its name and wraps, so the section is never wider than the dock
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self.values: dict[str, QLabel] = {}
        self._prefix = ""
        for key, title in self.FIELDS:
            self.values[key] = QLabel("…", objectName=f"server_{key}", wordWrap=True)
            form.addRow(self.tr(title), self.values[key])
        layout.addLayout(form)

    def set_server(self, url: str, model: str) -> None:
        self.title.setText(self.tr("Server · {model}").format(model=model))
        self.source.setText(self.tr("{url} · KV, requests and prefix hits from its /metrics; speed and TTFT "
                                    "measured from the stream here").format(url=html.escape(url)))
        self._prefix = ""
        for label in self.values.values():
            label.setText("…")

    def texts(self) -> dict[str, str]:
        return {key: label.text() for key, label in self.values.items()}

    def show_stats(self, snapshot: StatsSnapshot) -> None:
        server = snapshot.server
        not_reported = self.tr(NOT_REPORTED)
        if server is None or not server.reachable:
            text = self.tr("this server publishes no /metrics") if server is None else \
                self.tr("server unreachable: nothing answers at its address")
            for key in ("kv_usage", "running", "waiting", "prefix", "spec"):
                self.values[key].setText(text)
        else:
            self.values["kv_usage"].setText(not_reported if server.kv_usage is None else f"{server.kv_usage:.1%}")
            self.values["running"].setText(not_reported if server.requests_running is None
                                           else f"{server.requests_running}")
            self.values["waiting"].setText(not_reported if server.requests_waiting is None
                                           else f"{server.requests_waiting}")
            if server.prefix_cache_hit_rate is not None:    # a rate over the lookups since the previous look
                self._prefix = self.tr("{rate} of prompt tokens (latest requests)").format(
                    rate=f"{server.prefix_cache_hit_rate:.1%}")
            self.values["prefix"].setText(self._prefix or self.tr("no prefix lookups yet"))
            self.values["spec"].setText(self.tr("no drafts verified yet") if server.spec_acceptance is None else
                                        self.tr("{rate} of draft tokens accepted").format(
                                            rate=f"{server.spec_acceptance:.0%}"))
        self.values["decode"].setText(f"{snapshot.decode_tok_s:.1f} tok/s" if snapshot.decode_tok_s
                                      else self.tr("no reply measured yet"))
        self.values["ttft"].setText(f"{snapshot.ttft_s * 1000:.0f} ms" if snapshot.ttft_s
                                    else self.tr("no reply measured yet"))
