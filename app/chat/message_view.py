"""Past 450 lines on purpose: a message's widgets and the markdown splitting they render belong together.

One message of the conversation as widgets: markdown prose with hard line breaks, code blocks with a Copy button, a
reply's reasoning (gpt-oss's analysis channel) collapsed above it, and the marks under a reply that was cut or
stopped. ChatView (chat_view.py) stacks these.

Links in replies are model output: never followed by Qt itself. An http(s) link opens in the
browser after the user confirms it; any other scheme (file:, data:, custom handlers) never opens.
"""
from __future__ import annotations

import re

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QMessageBox, QPlainTextEdit, QPushButton, QSizePolicy,
                               QToolButton, QVBoxLayout, QWidget)

OPENABLE_SCHEMES = ("http", "https")
INTERRUPTED_MARK = QT_TRANSLATE_NOOP("MessageWidget", "Interrupted: kvchat closed before this reply finished")
# marks under a reply, by the engine's finish_reason; these two can be continued (shown translated)
FINISH_MARKS = {"length": (QT_TRANSLATE_NOOP("MessageWidget", "Cut at max tokens"),
                           QT_TRANSLATE_NOOP("MessageWidget", "The reply reached the max tokens set in Settings: "
                                                              "Continue writes more.")),
                "stopped": (QT_TRANSLATE_NOOP("MessageWidget", "Stopped"),
                            QT_TRANSLATE_NOOP("MessageWidget", "You stopped this reply: Continue picks it up where it "
                                                               "ended."))}
# under an empty reply that was stopped, by Stop or by closing the app, while the message before it was read
NO_REPLY_MARK = (QT_TRANSLATE_NOOP("MessageWidget", "Interrupted: no reply — Regenerate or edit to send again"),
                 QT_TRANSLATE_NOOP("MessageWidget", "The reply was stopped, or kvchat closed, while your message was "
                                                    "being read: none of the reply came."))


def confirm_link(url: str, parent: QWidget | None) -> QMessageBox | None:
    """Ask before opening an http(s) link from a reply; other schemes are refused outright (None)."""
    target = QUrl(url)
    if target.scheme().lower() not in OPENABLE_SCHEMES or not target.isValid() or not target.host():
        return None
    box = QMessageBox(QMessageBox.Icon.Question, QCoreApplication.translate("ChatView", "Open link?"),
                      QCoreApplication.translate("ChatView", "The reply links to:\n\n{url}\n\nOpen it in your "
                                                 "browser?").format(url=target.toDisplayString()),
                      QMessageBox.StandardButton.Open | QMessageBox.StandardButton.Cancel, parent)
    box.setObjectName("confirmLinkDialog")
    box.setDefaultButton(QMessageBox.StandardButton.Cancel)
    box.accepted.connect(lambda: QDesktopServices.openUrl(target))
    box.finished.connect(box.deleteLater)
    box.open()
    return box
_FENCE = re.compile(r"^(```|~~~)[ \t]*([\w+#.-]*)[^\n]*$", re.MULTILINE)
# a line that opens a block of code: `def f():`, `for x in y:`, `int main() {`, `function f(a) {`
_CODE_HEADER = re.compile(r"^\s*((async\s+)?def|class|if|elif|else|for|while|try|except|finally|with|switch|function|fn|"
                          r"func|public|private|static|void|int|struct|impl|match)\b.*[:{]\s*$"
                          r"|^\s*[\w.]+\s*\(.*\)\s*(->\s*\S+\s*)?[:{]\s*$")
# a line that is code on its own: imports, returns, assignments ending in ; or a closing brace
_CODE_LINE = re.compile(r"^\s*(import\s+\w|from\s+[\w.]+\s+import\b|#include\b|using\s+\w|package\s+\w|return\b"
                        r"|(const|let|var)\s+\w+\s*=|[}\])]+;?\s*$)|.*;\s*$")
# inside a run only: a call or an assignment on its own line (`print(x)`, `y = f(x)`)
_CODE_CONT = re.compile(r"^\s*([\w.]+\(.*\)|[\w.\[\]]+\s*[-+*/]?=\s*\S.*)\s*$")
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s")
_BLOCK_START = re.compile(r"^\s*([-*+]\s|\d+[.)]\s|#|>|\||```|~~~|---|\*\*\*|$)")


def hard_breaks(markdown: str) -> str:
    """Keep the model's line breaks: markdown joins a paragraph's lines into one; a trailing double space
    before a plain next line makes it a line break (lists, headings, quotes and tables are left alone)."""
    lines = markdown.split("\n")
    out = []
    for line, nxt in zip(lines, lines[1:] + [""]):
        plain = line.strip() and not line.lstrip().startswith("|")
        out.append(line.rstrip() + "  " if plain and not _BLOCK_START.match(nxt) else line)
    return "\n".join(out)


def _indented(line: str) -> bool:
    return line[:1] in (" ", "\t") and bool(line.strip()) and not _LIST_ITEM.match(line)


def split_unfenced_code(text: str) -> list[tuple[str, str, str]]:
    """Prose with code the model wrote without a fence: runs that look like code become ("code", "", ...)
    so their newlines and indentation survive (markdown would join the lines and drop the indent).

    A run starts at a block header followed by an indented line (`def f():` + `    return 1`) or at two
    code lines in a row (`import os` / `import sys`); it goes on over indented, code and blank lines."""
    lines = text.split("\n")
    segments: list[tuple[str, str, str]] = []
    prose: list[str] = []
    i = 0

    def starts_code(j: int) -> bool:
        nxt = lines[j + 1] if j + 1 < len(lines) else ""
        line = lines[j]
        if _indented(line) or not line.strip():
            return False
        return (bool(_CODE_HEADER.match(line)) and _indented(nxt)) or \
            (bool(_CODE_LINE.match(line)) and bool(_CODE_LINE.match(nxt) or _CODE_HEADER.match(nxt)))

    while i < len(lines):
        if not starts_code(i):
            prose.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines):
            line = lines[j]
            if _indented(line) or _CODE_LINE.match(line) or _CODE_HEADER.match(line) or _CODE_CONT.match(line):
                j += 1
            elif not line.strip() and j + 1 < len(lines) and (_indented(lines[j + 1]) or starts_code(j + 1)):
                j += 1
            else:
                break
        if "\n".join(prose).strip():
            segments.append(("text", "", "\n".join(prose).strip("\n")))
        prose = []
        segments.append(("code", "", "\n".join(lines[i:j]).rstrip()))
        i = j
    if "\n".join(prose).strip() or not segments:
        segments.append(("text", "", "\n".join(prose).strip("\n")))
    return segments


def split_segments(text: str) -> list[tuple[str, str, str]]:
    """Split markdown into ("text", "", prose) and ("code", language, code) pieces.

    An unterminated fence (a reply still streaming) makes the rest of the text a code block.
    """
    segments: list[tuple[str, str, str]] = []
    pos = 0
    while True:
        opening = _FENCE.search(text, pos)
        if opening is None:
            break
        fence, language = opening.group(1), opening.group(2)
        closing = re.compile(rf"^{re.escape(fence)}[ \t]*$", re.MULTILINE).search(text, opening.end())
        prose = text[pos:opening.start()]
        if prose.strip():
            segments += split_unfenced_code(prose.strip("\n"))
        code_start = opening.end() + 1
        code_end = closing.start() if closing else len(text)
        segments.append(("code", language, text[code_start:code_end].rstrip("\n")))
        if closing is None:
            return segments
        pos = closing.end()
    rest = text[pos:]
    if rest.strip() or not segments:
        segments += split_unfenced_code(rest.strip("\n"))
    return segments


class CodeBlock(QFrame):
    copied = Signal(str)

    def __init__(self, language: str, code: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        header = QWidget(objectName="codeHeader")
        row = QHBoxLayout(header)
        row.setContentsMargins(8, 2, 4, 2)
        self.language_label = QLabel(language or self.tr("code"), objectName="codeLanguage")
        self.copy_button = QPushButton(self.tr("Copy"), objectName="copyButton")
        self.copy_button.setToolTip(self.tr("Copy this code block to the clipboard"))
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        row.addWidget(self.language_label)
        row.addStretch(1)
        row.addWidget(self.copy_button)
        self.body = QLabel(objectName="codeBody")
        self.body.setTextFormat(Qt.TextFormat.PlainText)
        self.body.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.body.setWordWrap(True)
        self.body.setContentsMargins(10, 6, 10, 8)
        layout.addWidget(header)
        layout.addWidget(self.body)
        self.set_code(language, code)

    def set_code(self, language: str, code: str) -> None:
        self.language_label.setText(language or self.tr("code"))
        self.body.setText(code)

    def code(self) -> str:
        return self.body.text()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code())
        self.copy_button.setText(self.tr("Copied"))
        QTimer.singleShot(1200, self.copy_button, lambda: self.copy_button.setText(self.tr("Copy")))
        self.copied.emit(self.code())


class ReasoningSection(QFrame):
    """What the model reasoned before its answer: a "Reasoning" toggle over the text, collapsed until clicked."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("reasoningSection")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        self.toggle = QToolButton(self, objectName="reasoningToggle")
        self.toggle.setCheckable(True)
        self.toggle.setAutoRaise(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.toggle.setCursor(Qt.CursorShape.PointingHandCursor)
        self.toggle.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.toggle.setStyleSheet("QToolButton { color: #64748b; border: none; padding: 0; }")
        self.toggle.setToolTip(self.tr("What the model reasoned before it answered: not part of the answer, and "
                                       "not sent back to it with the next message"))
        self.toggle.toggled.connect(self._expand)
        self.body = QLabel(self, objectName="reasoningText")
        self.body.setTextFormat(Qt.TextFormat.PlainText)
        self.body.setWordWrap(True)
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.body.setStyleSheet("QLabel { color: #64748b; border-left: 2px solid #cbd5e1; padding-left: 8px; }")
        self.body.setVisible(False)
        layout.addWidget(self.toggle, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self.body)
        self.set_reasoning("", live=False)

    def set_reasoning(self, text: str, live: bool) -> None:
        """live: the reply is still streaming ("Reasoning…")."""
        self.body.setText(text)
        self.toggle.setText(self.tr("Reasoning…") if live else self.tr("Reasoning"))
        self.setVisible(bool(text))

    def expanded(self) -> bool:
        return self.toggle.isChecked()

    def _expand(self, on: bool) -> None:
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.body.setVisible(on)


class MessageWidget(QFrame):
    """One message. `set_text` keeps existing segment widgets when the structure is unchanged. A reply's reasoning
    (`set_reasoning`) shows above its text in a ReasoningSection, collapsed; `text()` is the answer alone."""

    def __init__(self, role: str, author: str, text: str = "", parent: QWidget | None = None, request=None):
        super().__init__(parent)
        self.role = role
        self.setObjectName("userMessage" if role == "user" else "assistantMessage" if role == "assistant"
                           else "noticeMessage")
        # Preferred, not Maximum: a wrapped reply needs more height at its width than its size hint says
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(12, 8, 12, 10)
        self._layout.setSpacing(6)
        self.author_label = QLabel(author, objectName="messageAuthor")
        self._layout.addWidget(self.author_label)
        self._segments: list[tuple[str, str, str]] = []
        self._widgets: list[QWidget] = []
        self._text = ""
        self._reasoning = ""
        self.reasoning_section: ReasoningSection | None = None      # made for the first reasoning shown
        self.set_text(text)
        if role in ("user", "assistant"):
            self._build_footer(request or (lambda name: None))

    def text(self) -> str:
        return self._text

    def reasoning(self) -> str:
        return self._reasoning

    def has_reply(self) -> bool:
        """Some of the reply came: its text, or reasoning alone."""
        return bool(self._text or self._reasoning)

    def set_reasoning(self, text: str, live: bool = False) -> None:
        """Show the reply's reasoning above its text, collapsed unless the user opened it; "" hides it."""
        self._reasoning = text
        if self.reasoning_section is None:
            if not text:
                return
            self.reasoning_section = ReasoningSection(self)
            self._layout.insertWidget(1, self.reasoning_section)       # after the author, before the text
        self.reasoning_section.set_reasoning(text, live)

    def _body_index(self) -> int:
        """Where the text's widgets begin in the layout: after the author and the reasoning."""
        return 1 + (self.reasoning_section is not None)

    def code_blocks(self) -> list[CodeBlock]:
        return [w for w in self._widgets if isinstance(w, CodeBlock)]

    def set_text(self, text: str) -> None:
        self._text = text
        segments = split_segments(text) if self.role != "notice" else [("text", "", text)]
        same_shape = [s[0] for s in segments] == [s[0] for s in self._segments]
        if not same_shape:
            for widget in self._widgets:
                self._layout.removeWidget(widget)
                widget.hide()           # at once: deleteLater waits for the event loop
                widget.deleteLater()
            self._widgets = [self._make_widget(kind) for kind, _, _ in segments]
            for i, widget in enumerate(self._widgets):
                self._layout.insertWidget(self._body_index() + i, widget)   # after the author, before marks and footer
        for widget, (kind, language, body) in zip(self._widgets, segments):
            if kind == "code":
                widget.set_code(language, body)
                continue
            if self.role == "assistant":
                body = hard_breaks(body)
            if widget.text() != body:
                widget.setText(body)
            widget.setVisible(bool(body))       # an empty reply (none came) is its mark alone, not a blank line
        self._segments = segments

    def _make_widget(self, kind: str) -> QWidget:
        if kind == "code":
            return CodeBlock("", "", self)
        label = QLabel(self, objectName="messageText")
        label.setTextFormat(Qt.TextFormat.PlainText if self.role == "user" else Qt.TextFormat.MarkdownText)
        label.setWordWrap(True)
        label.setOpenExternalLinks(False)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        label.linkActivated.connect(lambda url: confirm_link(url, self))
        return label

    def mark_interrupted(self) -> None:
        self.interrupted_label = QLabel(self.tr(INTERRUPTED_MARK), self, objectName="interruptedMark")
        self.interrupted_label.setStyleSheet("color: #9a6700; font-style: italic;")
        self.interrupted_label.setToolTip(self.tr("The app stopped (a crash or power loss) while this reply "
                                                  "streamed; what had arrived was saved."))
        self._layout.insertWidget(self._body_index() + len(self._widgets), self.interrupted_label)

    def is_interrupted(self) -> bool:
        return getattr(self, "interrupted_label", None) is not None

    # --- actions under the message (copy, edit, delete, regenerate, continue, versions) ---

    def _build_footer(self, request) -> None:
        """The row under the message: its mark, reply versions and action buttons. `request(name)` runs one."""
        self._request = request

        def request(name: str) -> None:    # looked up when clicked: the chat view sets _request after building
            self._request(name)
        self.message_id: int | None = None
        self.finish = ""
        footer = QWidget(self, objectName="messageFooter")
        row = QHBoxLayout(footer)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(2)
        self.finish_label = QLabel(footer, objectName="finishMark")
        self.finish_label.setWordWrap(True)     # a narrow chat wraps the mark rather than cutting the buttons
        self.finish_label.setVisible(False)
        self.previous_button = self._action_button(footer, "‹", self.tr("Show the previous reply"),
                                                   lambda: request("previous"))
        self.version_label = QLabel(footer, objectName="versionLabel")
        self.next_button = self._action_button(footer, "›", self.tr("Show the next reply"), lambda: request("next"))
        row.addWidget(self.finish_label)
        for widget in (self.previous_button, self.version_label, self.next_button):
            widget.setVisible(False)
            row.addWidget(widget)
        row.addStretch(1)
        self.continue_button = self._action_button(footer, self.tr("Continue"), self.tr("Write more of this reply"),
                                                   lambda: request("continue"))
        self.regenerate_button = self._action_button(footer, self.tr("Regenerate"),
                                                     self.tr("Write a new reply (this one is kept: the arrows switch "
                                                             "back)"),
                                                     lambda: request("regenerate"))
        self.edit_button = self._action_button(footer, self.tr("Edit"), self.tr("Change this message and send it "
                                                                                "again; the messages after it are "
                                                                                "removed"), self.start_edit)
        self.copy_message_button = self._action_button(footer, self.tr("Copy"), self.tr("Copy this message's text"),
                                                       lambda: request("copy"))
        self.delete_button = self._action_button(footer, self.tr("Delete"),
                                                 self.tr("Delete this message and its reply (Undo in the status bar)")
                                                 if self.role == "user" else
                                                 self.tr("Delete this reply and the message it answers (Undo in the "
                                                         "status bar)"), lambda: request("delete"))
        for button in (self.continue_button, self.regenerate_button, self.edit_button):
            button.setVisible(False)
            row.addWidget(button)
        row.addWidget(self.copy_message_button)
        row.addWidget(self.delete_button)
        self.footer = footer
        self._layout.addWidget(footer)
        self.editor: QPlainTextEdit | None = None
        self.edit_button.setVisible(self.role == "user")

    @staticmethod
    def _action_button(parent: QWidget, text: str, tip: str, slot) -> QPushButton:
        button = QPushButton(text, parent, objectName="messageAction")
        button.setToolTip(tip)
        button.setCursor(Qt.CursorShape.PointingHandCursor)
        button.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        button.clicked.connect(slot)
        return button

    def set_finish(self, reason: str) -> None:
        """Mark why the reply ended: "stopped" and "length" (cut at max tokens) show under it; an empty stopped
        reply says that none came."""
        self.finish = reason or ""
        mark = NO_REPLY_MARK if self.finish == "stopped" and not self.has_reply() else FINISH_MARKS.get(self.finish)
        self.finish_label.setText(self.tr(mark[0]) if mark else "")
        self.finish_label.setToolTip(self.tr(mark[1]) if mark else "")
        self.finish_label.setVisible(mark is not None)

    def set_versions(self, chosen: int, count: int) -> None:
        """`‹ 2/3 ›` when the reply was regenerated: version chosen+1 of count."""
        self.versions = (chosen, count)
        shown = count > 1
        self.version_label.setText(f"{chosen + 1}/{count}")
        for widget in (self.previous_button, self.version_label, self.next_button):
            widget.setVisible(shown)
        self.previous_button.setEnabled(shown and chosen > 0)
        self.next_button.setEnabled(shown and chosen < count - 1)

    def set_actions(self, last: bool, busy: bool, can_rewrite: bool = True) -> None:
        """Regenerate on the last reply, Continue on a last reply that was cut (where the engine can: not a remote
        server); nothing runs while busy."""
        is_reply = self.role == "assistant" and can_rewrite
        self.regenerate_button.setVisible(is_reply and last)
        self.continue_button.setVisible(is_reply and last and self.finish in FINISH_MARKS and self.has_reply())
        for button in (self.regenerate_button, self.continue_button, self.edit_button, self.delete_button,
                       self.previous_button, self.next_button):
            button.setEnabled(not busy and (button not in (self.previous_button, self.next_button)
                                            or self._can_step(button)))

    def _can_step(self, button) -> bool:
        chosen, count = getattr(self, "versions", (0, 1))
        return chosen > 0 if button is self.previous_button else chosen < count - 1

    def start_edit(self) -> None:
        """Edit in place: the text becomes an editor with Send and Cancel."""
        if self.editor is not None:
            return
        self.editor = QPlainTextEdit(self, objectName="messageEditor")
        self.editor.setPlainText(self.text())
        self.editor.setMinimumHeight(60)
        self.editor.setMaximumHeight(180)
        buttons = QWidget(self, objectName="editButtons")
        row = QHBoxLayout(buttons)
        row.setContentsMargins(0, 0, 0, 0)
        row.addStretch(1)
        cancel = QPushButton(self.tr("Cancel"), buttons, objectName="editCancel")
        send = QPushButton(self.tr("Send"), buttons, objectName="editSend")
        send.setToolTip(self.tr("Send the edited message; the messages after it are removed"))
        cancel.clicked.connect(self.cancel_edit)
        send.clicked.connect(lambda: self._request("edit"))
        row.addWidget(cancel)
        row.addWidget(send)
        self._edit_buttons = buttons
        for widget in self._widgets + [self.footer]:
            widget.setVisible(False)
        self._layout.addWidget(self.editor)
        self._layout.addWidget(buttons)
        self.editor.setFocus()

    def edited_text(self) -> str:
        return self.editor.toPlainText().strip() if self.editor is not None else self.text()

    def cancel_edit(self) -> None:
        if self.editor is None:
            return
        for widget in (self.editor, self._edit_buttons):
            self._layout.removeWidget(widget)
            widget.deleteLater()
        self.editor = None
        for widget in self._widgets + [self.footer]:
            widget.setVisible(True)
