"""The server's API key, kept as a secret: in the system keyring, else in a file only you can read.

Where `keyring` finds a real backend (Secret Service, KWallet, macOS Keychain, Windows
Credential Locker) the key lives there and never in the settings file. Without one, the key
is remembered only when the person ticks "remember": then in a file next to the settings,
created with mode 0600 (read and write by its owner only); unticked, it lasts until quit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a type here: the engine side imports this module without Qt
    from PySide6.QtCore import QSettings

SERVICE = "PrefixLab"
USERNAME = "server_api_key"
FILE_NAME = "server-api-key"
PLAIN_KEY = "settings/server_api_key"  # where earlier versions kept the key, in plain text


def _keyring():
    """The keyring module when a usable backend exists, else None."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    try:
        backend = keyring.get_keyring()
    except Exception:  # noqa: BLE001 - a broken keyring configuration means: no keyring
        return None
    if isinstance(backend, fail.Keyring) or getattr(backend, "priority", 0) <= 0:
        return None
    return keyring


def keyring_available() -> bool:
    """Whether a system keyring backend exists to keep the key in."""
    return _keyring() is not None


def key_file(store: QSettings) -> Path:
    """The 0600 file that keeps the key without a keyring: beside the settings file."""
    return Path(store.fileName()).with_name(f"{Path(store.fileName()).stem}-{FILE_NAME}")


def _write_private(path: Path, text: str) -> None:
    """Write `text` to a file that only its owner can read, whatever mode an old file had."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)


def _forget_file(store: QSettings) -> None:
    try:
        key_file(store).unlink()
    except FileNotFoundError:
        pass


def save_api_key(store: QSettings, key: str, remember: bool) -> str:
    """Keep `key` and return where: "keyring", "file", "session" (not remembered) or "none" (empty)."""
    store.remove(PLAIN_KEY)  # never in the settings file, also not from an earlier version
    kr = _keyring()
    if kr is not None:
        try:
            if key:
                kr.set_password(SERVICE, USERNAME, key)
            else:
                _delete(kr)
            _forget_file(store)
            return "keyring" if key else "none"
        except Exception:  # noqa: BLE001 - a locked or failing keyring: fall back to the file rule
            pass
    if key and remember:
        _write_private(key_file(store), key)
        return "file"
    _forget_file(store)
    return "session" if key else "none"


def _delete(kr) -> None:
    try:
        kr.delete_password(SERVICE, USERNAME)
    except Exception:  # noqa: BLE001 - keyring raises PasswordDeleteError when there is none
        pass


def load_api_key(store: QSettings) -> str:
    """The remembered key ("" when none); a plain-text key of an earlier version moves out of the settings."""
    plain = store.value(PLAIN_KEY, None)
    if plain:
        key = str(plain)
        save_api_key(store, key, remember=True)  # it was remembered before: keep it so, safely
        return key
    kr = _keyring()
    if kr is not None:
        try:
            key = kr.get_password(SERVICE, USERNAME)
            if key:
                return key
        except Exception:  # noqa: BLE001 - an unreadable keyring: try the file
            pass
    try:
        return key_file(store).read_text("utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return ""
