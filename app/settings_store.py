"""User settings in QSettings: model, cache and sampling choices, system prompt, window layout.

Configs are stored as JSON text, so an INI file and the native registry read back the same types.
KVCHAT_SETTINGS_FILE (or the `path` argument) points the store at an INI file; tests use that.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from PySide6.QtCore import QByteArray, QSettings

from engine.config import CacheConfig, ConfigError, SamplingParams

from .history import cache_from_json, cache_to_json

DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, max_new_tokens=256)


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """An OpenAI-compatible server the app chats through instead of a model on this computer."""

    base_url: str
    api_key: str = ""
    model: str = ""                     # "" = the first model the server lists

    def label(self) -> str:
        from PySide6.QtCore import QCoreApplication
        return QCoreApplication.translate("RemoteSettings", "{model} on {url}").format(
            model=self.model or QCoreApplication.translate("RemoteSettings", "server model"), url=self.base_url)


@dataclass(frozen=True, slots=True)
class AppSettings:
    """Everything the Settings dialog edits."""

    model: str = "default"
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampling: SamplingParams = DEFAULT_SAMPLING
    system_prompt: str = ""
    remote: RemoteSettings | None = None    # None: the model runs on this computer


class SettingsStore:
    def __init__(self, path: str | os.PathLike | None = None):
        path = path or os.environ.get("KVCHAT_SETTINGS_FILE")
        if path:
            self._qs = QSettings(str(path), QSettings.Format.IniFormat)
        else:
            self._qs = QSettings("kvchat", "kvchat")

    @property
    def file_name(self) -> str:
        return self._qs.fileName()

    def load(self) -> AppSettings:
        defaults = AppSettings()
        cache = cache_from_json(str(self._qs.value("engine/cache", ""))) or defaults.cache
        sampling = _sampling_from_json(str(self._qs.value("engine/sampling", ""))) or defaults.sampling
        return AppSettings(model=str(self._qs.value("engine/model", defaults.model)) or defaults.model,
                           cache=cache, sampling=sampling,
                           system_prompt=str(self._qs.value("chat/system_prompt", "")), remote=self._load_remote())

    def _load_remote(self) -> RemoteSettings | None:
        if str(self._qs.value("engine/kind", "local")) != "server":
            return None
        url = str(self._qs.value("server/base_url", "") or "")
        if not url:
            return None
        return RemoteSettings(url, str(self._qs.value("server/api_key", "") or ""),
                              str(self._qs.value("server/model", "") or ""))

    def save(self, settings: AppSettings) -> None:
        self._qs.setValue("engine/model", settings.model)
        self._qs.setValue("engine/cache", cache_to_json(settings.cache))
        self._qs.setValue("engine/sampling", json.dumps(asdict(settings.sampling), sort_keys=True))
        self._qs.setValue("chat/system_prompt", settings.system_prompt)
        self._qs.setValue("engine/kind", "server" if settings.remote else "local")
        if settings.remote is not None:     # the last server stays filled in when the user goes back to local
            self._qs.setValue("server/base_url", settings.remote.base_url)
            self._qs.setValue("server/api_key", settings.remote.api_key)
            self._qs.setValue("server/model", settings.remote.model)
        self._qs.sync()

    def last_server(self) -> RemoteSettings | None:
        """The server saved last, even while the app runs locally (to fill in the dialog)."""
        url = str(self._qs.value("server/base_url", "") or "")
        return RemoteSettings(url, str(self._qs.value("server/api_key", "") or ""),
                              str(self._qs.value("server/model", "") or "")) if url else None

    def layout(self, key: str) -> QByteArray | None:
        value = self._qs.value(f"window/{key}")
        return value if isinstance(value, QByteArray) and not value.isEmpty() else None

    def set_layout(self, key: str, state: QByteArray) -> None:
        self._qs.setValue(f"window/{key}", state)

    def last_conversation(self) -> int | None:
        value = self._qs.value("chat/last_conversation", None)
        try:
            return int(value) if value not in (None, "", "None") else None
        except (TypeError, ValueError):
            return None

    def set_last_conversation(self, conversation_id: int | None) -> None:
        self._qs.setValue("chat/last_conversation", "" if conversation_id is None else int(conversation_id))

    def library_folders(self) -> list[str]:
        """Folders the user added to the Models page."""
        try:
            folders = json.loads(str(self._qs.value("library/folders", "[]")))
        except ValueError:
            return []
        return [str(f) for f in folders] if isinstance(folders, list) else []

    def set_library_folders(self, folders: list[str]) -> None:
        self._qs.setValue("library/folders", json.dumps(list(folders)))
        self._qs.sync()

    def language(self) -> str:
        """The interface language chosen in Settings: "system" (the default), "en" or "zh_CN"."""
        value = str(self._qs.value("ui/language", "system") or "system")
        return value if value in ("system", "en", "zh_CN") else "system"

    def set_language(self, language: str) -> None:
        self._qs.setValue("ui/language", language)
        self._qs.sync()

    def sync(self) -> None:
        self._qs.sync()


def _sampling_from_json(text: str) -> SamplingParams | None:
    try:
        return SamplingParams(**json.loads(text))
    except (ValueError, TypeError, ConfigError):
        return None
