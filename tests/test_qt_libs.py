"""Before Qt starts, `prefixlab` names what its platform plugin cannot load and the command that
installs it (Qt itself would abort with "no Qt platform plugin could be initialized")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from app.desktop.qt_libs import (
    install_command,
    missing_libraries,
    packages,
    platform_name,
    qt_dir,
    startup_problem,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ldd_names_a_library_the_loader_cannot_find(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("ldd") is None:
        pytest.skip("needs a C compiler and ldd to build a library with a missing dependency")
    (tmp_path / "a.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "b.c").write_text("int gone(void);\nint user(void) { return gone(); }\n")
    gone = tmp_path / "libprefixlab-gone.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libprefixlab-gone.so.1", "-o", str(gone),
                    str(tmp_path / "a.c")], check=True)
    user = tmp_path / "libuser.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(user), str(tmp_path / "b.c"), str(gone)], check=True)
    gone.unlink()  # as if its package were removed
    assert missing_libraries(user) == ["libprefixlab-gone.so.1"]
    assert install_command(["libxcb-cursor.so.0", "libprefixlab-gone.so.1"]) == (
        "sudo apt-get install -y libxcb-cursor0 and the packages that provide libprefixlab-gone.so.1")


def test_the_xcb_libraries_map_to_their_debian_packages():
    # What Qt 6.5+ asks for by name in its own message, and what `ldd libqxcb.so` lists.
    assert packages(["libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1",
                     "libxkbcommon-x11.so.0"]) == ["libxcb-cursor0", "libxcb-icccm4", "libxcb-keysyms1",
                                                   "libxkbcommon-x11-0"]


def test_the_platform_is_the_one_qt_would_try_first():
    assert platform_name({"QT_QPA_PLATFORM": "offscreen"}) == "offscreen"
    assert platform_name({"QT_QPA_PLATFORM": "xcb;offscreen"}) == "xcb"
    assert platform_name({"DISPLAY": ":0"}) == "xcb"
    assert platform_name({"WAYLAND_DISPLAY": "wayland-0", "XDG_SESSION_TYPE": "wayland"}) == "wayland"
    assert (qt_dir() / "plugins" / "platforms" / "libqxcb.so").is_file()  # the wheel's own plugin


def test_prefixlab_without_a_display_stops_before_qt_and_says_so():
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    out = subprocess.run([sys.executable, "-m", "app.cli"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "DISPLAY is not set" in out.stderr and "QT_QPA_PLATFORM=offscreen" in out.stderr
    assert "could not connect" not in out.stderr and "Aborted" not in out.stderr
    assert startup_problem({"QT_QPA_PLATFORM": "offscreen"}) == ""  # set-up installed what it needs
