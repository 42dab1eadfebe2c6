"""The server's API key is a secret: in the keyring where one exists, else in a 0600 file only when
"remember" is ticked; never in the settings file (QSettings, isolated per test)."""

from __future__ import annotations

import os
import stat

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import keyring  # noqa: E402
import pytest  # noqa: E402
from keyring.backend import KeyringBackend  # noqa: E402
from keyring.backends import fail  # noqa: E402

from app.desktop.secrets import PLAIN_KEY, key_file, keyring_available, load_api_key  # noqa: E402
from app.desktop.settings import AppSettings, qsettings  # noqa: E402

KEY = "sk-test-5f1c9a77"


class MemoryKeyring(KeyringBackend):
    """A keyring backend in memory: what the system's Secret Service or Keychain would hold."""

    priority = 1

    def __init__(self):
        super().__init__()
        self.items: dict[tuple[str, str], str] = {}

    def set_password(self, service, username, password):
        self.items[(service, username)] = password

    def get_password(self, service, username):
        return self.items.get((service, username))

    def delete_password(self, service, username):
        self.items.pop((service, username), None)


@pytest.fixture
def no_keyring():
    before = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    yield
    keyring.set_keyring(before)


@pytest.fixture
def memory_keyring():
    before = keyring.get_keyring()
    ring = MemoryKeyring()
    keyring.set_keyring(ring)
    yield ring
    keyring.set_keyring(before)


def ini_text() -> str:
    store = qsettings()
    store.sync()
    with open(store.fileName(), encoding="utf-8") as fh:
        return fh.read()


def save(key: str, remember: bool) -> None:
    AppSettings.from_dict({**AppSettings().to_dict(), "server_api_key": key,
                           "server_api_key_remember": remember}).save(qsettings())


def test_without_a_keyring_an_unticked_key_lasts_only_this_session(gui_settings, no_keyring):
    assert not keyring_available()
    save(KEY, remember=False)
    assert KEY not in ini_text()
    assert not key_file(qsettings()).exists()
    assert AppSettings.load(qsettings()).server_api_key == ""  # the next start has no key


def test_without_a_keyring_a_remembered_key_is_in_a_file_only_its_owner_reads(gui_settings, no_keyring):
    save(KEY, remember=True)
    path = key_file(qsettings())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text("utf-8") == KEY
    assert KEY not in ini_text()
    assert AppSettings.load(qsettings()).server_api_key == KEY
    save(KEY, remember=False)  # unticked later: the file goes
    assert not path.exists()
    save(KEY, remember=True)
    save("", remember=True)  # an emptied key is forgotten too
    assert not path.exists() and AppSettings.load(qsettings()).server_api_key == ""


def test_with_a_keyring_the_key_lives_there(gui_settings, memory_keyring):
    assert keyring_available()
    save(KEY, remember=False)  # a keyring keeps it: that is what a keyring is for
    assert memory_keyring.items == {("PrefixLab", "server_api_key"): KEY}
    assert KEY not in ini_text() and not key_file(qsettings()).exists()
    assert AppSettings.load(qsettings()).server_api_key == KEY
    save("", remember=False)
    assert memory_keyring.items == {}


def test_a_plain_text_key_of_an_earlier_version_moves_out_of_the_settings(gui_settings, memory_keyring):
    store = qsettings()
    store.setValue(PLAIN_KEY, KEY)
    store.sync()
    assert KEY in ini_text()
    assert load_api_key(store) == KEY
    assert KEY not in ini_text()
    assert memory_keyring.items[("PrefixLab", "server_api_key")] == KEY


def test_the_settings_dialog_remembers_a_ticked_key_for_the_next_start(open_desktop, no_keyring):
    d = open_desktop()
    dlg = d.settings_dialog()
    dlg.server_api_key.setText(KEY)
    dlg.server_api_key_remember.setChecked(True)
    dlg.accept()
    d.controller.apply_settings(AppSettings.from_dict(dlg.result_values))
    assert d.controller.settings.server_api_key == KEY
    assert KEY not in ini_text()
    assert stat.S_IMODE(key_file(qsettings()).stat().st_mode) == 0o600
    again = open_desktop()  # the next start
    assert again.controller.settings.server_api_key == KEY
    assert again.settings_dialog().server_api_key_remember.isChecked()
