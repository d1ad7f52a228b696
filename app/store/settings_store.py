"""User settings in QSettings: model, cache and sampling choices, system prompt, window layout.

Configs are stored as JSON text, so an INI file and the native registry read back the same types.
KVCHAT_SETTINGS_FILE (or the `path` argument) points the store at an INI file; tests use that.
The file is the user's alone (0600, and Qt's atomic save keeps that mode); a server's API key goes to the
system keyring where a real one is available, else into that file.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import asdict, dataclass, field

from PySide6.QtCore import QByteArray, QSettings

from kvchat.engine.config import ACTIVATION_MODES, MAX_DRAFTS, PREFILL_MODES, CacheConfig, ConfigError, SamplingParams

from kvchat.app.store.history import cache_from_json, cache_to_json

log = logging.getLogger(__name__)
DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, top_k=40, max_new_tokens=256)
KEYRING_SERVICE = "kvchat"
IN_KEYRING = "keyring"          # server/api_key_in: where the key is, when not in this file
SPEC_METHODS = ("off", "lookup")    # what Settings offers: a draft model needs a model file of its own
# off in the app until its cost to the window is understood: with prompt lookup on, the longest pause of the GUI loop
# while the default model answered grew from 25-40 ms to 92-117 ms (test_app_engine's stall meter); the engine, the
# CLI and the server speculate by default
DEFAULT_SPECULATIVE = ("off", 8)


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
        if self._qs.format() == QSettings.Format.NativeFormat and os.name != "posix":
            return                      # the registry: no file to guard
        _private_file(self._qs.fileName())

    @property
    def file_name(self) -> str:
        return self._qs.fileName()

    def load(self) -> AppSettings:
        defaults = AppSettings()
        cache = _cache_from_json(str(self._qs.value("engine/cache", ""))) or defaults.cache
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
        return RemoteSettings(url, self._api_key(url), str(self._qs.value("server/model", "") or ""))

    def _api_key(self, url: str) -> str:
        if str(self._qs.value("server/api_key_in", "") or "") == IN_KEYRING:
            ring = _keyring()
            try:
                return (ring.get_password(KEYRING_SERVICE, url) or "") if ring else ""
            except Exception as exc:  # noqa: BLE001 - a locked or broken keyring: the user types the key again
                log.warning("cannot read the API key from the system keyring: %s", exc)
                return ""
        return str(self._qs.value("server/api_key", "") or "")

    def _set_api_key(self, url: str, key: str) -> None:
        """Into the system keyring when one works (the file then holds no key), else into this 0600 file."""
        ring = _keyring() if key else None
        if ring is not None:
            try:
                ring.set_password(KEYRING_SERVICE, url, key)
                self._qs.setValue("server/api_key", "")
                self._qs.setValue("server/api_key_in", IN_KEYRING)
                return
            except Exception as exc:  # noqa: BLE001 - any keyring failure falls back to the private file
                log.warning("cannot store the API key in the system keyring (%s): kept in %s", exc, self.file_name)
        self._qs.setValue("server/api_key", key)
        self._qs.remove("server/api_key_in")

    def save(self, settings: AppSettings) -> None:
        self._qs.setValue("engine/model", settings.model)
        self._qs.setValue("engine/cache", cache_to_json(settings.cache))
        self._qs.setValue("engine/sampling", json.dumps(asdict(settings.sampling), sort_keys=True))
        self._qs.setValue("chat/system_prompt", settings.system_prompt)
        self._qs.setValue("engine/kind", "server" if settings.remote else "local")
        if settings.remote is not None:     # the last server stays filled in when the user goes back to local
            self._qs.setValue("server/base_url", settings.remote.base_url)
            self._set_api_key(settings.remote.base_url, settings.remote.api_key)
            self._qs.setValue("server/model", settings.remote.model)
        self._qs.sync()

    def last_server(self) -> RemoteSettings | None:
        """The server saved last, even while the app runs locally (to fill in the dialog)."""
        url = str(self._qs.value("server/base_url", "") or "")
        return RemoteSettings(url, self._api_key(url), str(self._qs.value("server/model", "") or "")) if url else None

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

    def export_dir(self) -> str:
        """The folder the last export went to ("" before the first)."""
        return str(self._qs.value("chat/export_dir", "") or "")

    def set_export_dir(self, folder: str) -> None:
        self._qs.setValue("chat/export_dir", folder)

    def kv_disk_budget_mb(self) -> float:
        """The disk budget of saved conversation caches (warm conversations), MiB; 2048 unless changed."""
        try:
            value = float(self._qs.value("kv/disk_budget_mb", 2048.0))
        except (TypeError, ValueError):
            return 2048.0
        return value if 0 <= value <= 1_048_576 else 2048.0

    def set_kv_disk_budget_mb(self, value: float) -> None:
        self._qs.setValue("kv/disk_budget_mb", float(value))
        self._qs.sync()

    def speculative(self) -> tuple[str, int]:
        """Speculative decoding (method, most draft tokens per step); off (8 drafts once on) unless changed."""
        method = str(self._qs.value("engine/speculative", DEFAULT_SPECULATIVE[0]) or "")
        try:
            k = int(self._qs.value("engine/spec_tokens", DEFAULT_SPECULATIVE[1]))
        except (TypeError, ValueError):
            k = DEFAULT_SPECULATIVE[1]
        return (method if method in SPEC_METHODS else DEFAULT_SPECULATIVE[0],
                k if 1 <= k <= MAX_DRAFTS else DEFAULT_SPECULATIVE[1])

    def set_speculative(self, method: str, k: int) -> None:
        self._qs.setValue("engine/speculative", method)
        self._qs.setValue("engine/spec_tokens", int(k))
        self._qs.sync()

    def _choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = str(self._qs.value(key, default) or "")
        return value if value in choices else default       # an unknown (damaged) value reads as the default

    def _set(self, key: str, value) -> None:
        self._qs.setValue(key, value)
        self._qs.sync()

    def prefill(self) -> str:
        """The prompt GEMM's precision (EngineConfig.prefill): auto unless changed."""
        return self._choice("engine/prefill", PREFILL_MODES, "auto")

    def set_prefill(self, mode: str) -> None:
        self._set("engine/prefill", mode)

    def activations(self) -> str:
        """Decode rows' activations (EngineConfig.activations): int16 unless changed."""
        return self._choice("engine/activations", ACTIVATION_MODES, "int16")

    def set_activations(self, mode: str) -> None:
        self._set("engine/activations", mode)

    def sync(self) -> None:
        self._qs.sync()


def _private_file(name: str) -> None:
    """The settings file exists and is 0600 before Qt first writes it: Qt's atomic save (a 0600 temporary file
    renamed over it) keeps an existing file's mode, so the key is never readable by others, not even briefly."""
    try:
        folder = os.path.dirname(name)
        if folder and not os.path.isdir(folder):
            os.makedirs(folder, mode=0o700)
        fd = os.open(name, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:      # written by an earlier version, 0644
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    except OSError as exc:          # a read-only home: Qt reports the failed save itself
        log.warning("cannot make the settings file %s private: %s", name, exc)


def _keyring():
    """The keyring module when a real system keyring backs it (Secret Service, macOS, Windows), else None.

    Its fail and null backends, and plaintext files (keyrings.alt), have priority below 1: no better than ours."""
    try:
        import keyring
        backend = keyring.get_keyring()
        return keyring if getattr(backend, "priority", 0) >= 1 else None
    except Exception:  # noqa: BLE001 - not installed, or a backend that breaks on import
        return None


# Keep what matters and Fetch what is needed (CacheConfig.eviction, .retrieval_blocks): a file from before them lacks
# them (their defaults), and a damaged or impossible value of one falls back to its default, not the whole cache
CHOICE_FIELDS = ("retrieval_blocks", "eviction")


def _cache_from_json(text: str) -> CacheConfig | None:
    """The stored cache config; when only eviction or retrieval_blocks keep it from forming, the rest of it with
    that one (else both) at its default. None when it does not parse either way."""
    try:
        cache = cache_from_json(text)
        if cache is not None:
            return cache
        fields = json.loads(text)
    except (ValueError, RecursionError):        # not JSON, or JSON nested past Python's stack
        return None
    if not isinstance(fields, dict) or not any(name in fields for name in CHOICE_FIELDS):
        return None
    for dropped in (("retrieval_blocks",), ("eviction",), CHOICE_FIELDS):
        cache = cache_from_json(json.dumps({k: v for k, v in fields.items() if k not in dropped}))
        if cache is not None:
            log.warning("the stored cache settings %.200r cannot be used: their defaults instead",
                        {k: fields.get(k) for k in dropped})
            return cache
    return None


def _sampling_from_json(text: str) -> SamplingParams | None:
    try:
        return SamplingParams(**json.loads(text))
    except (ValueError, TypeError, ConfigError):
        return None
