"""Which system libraries Qt's wheel still needs, found with `ldd` before Qt starts.

When Qt cannot load its platform plugin it aborts the process with a generic message
("no Qt platform plugin could be initialized"), so the check has to run first: `ldd`
on QtGui and on the platform plugin lists every library the dynamic loader cannot find,
and the Debian package of each is the one command that fixes it.

    python -m app.desktop.qt_libs --packages   # every missing Debian package (offscreen and xcb)
    python -m app.desktop.qt_libs --check      # exit 1 with the fix when this display cannot start Qt
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# soname -> Debian package (bookworm and later): what QtGui and the xcb plugin link to.
DEBIAN_PACKAGES = {
    "libEGL.so.1": "libegl1", "libGL.so.1": "libgl1", "libOpenGL.so.0": "libopengl0",
    "libGLX.so.0": "libglx0", "libGLdispatch.so.0": "libglvnd0",
    "libxkbcommon.so.0": "libxkbcommon0", "libfontconfig.so.1": "libfontconfig1",
    "libfreetype.so.6": "libfreetype6", "libglib-2.0.so.0": "libglib2.0-0",
    "libgthread-2.0.so.0": "libglib2.0-0", "libdbus-1.so.3": "libdbus-1-3",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0", "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4", "libxcb-util.so.1": "libxcb-util1",
    "libxcb-image.so.0": "libxcb-image0", "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0", "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shm.so.0": "libxcb-shm0", "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0", "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0", "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb-xinerama.so.0": "libxcb-xinerama0", "libxcb.so.1": "libxcb1",
    "libX11-xcb.so.1": "libx11-xcb1", "libX11.so.6": "libx11-6",
}
# Platforms that need no display server; the rest need DISPLAY (xcb) or WAYLAND_DISPLAY.
HEADLESS = ("offscreen", "minimal", "vnc")
_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.MULTILINE)


def qt_dir() -> Path | None:
    """PySide6's bundled Qt (its lib/ and plugins/), found without importing PySide6."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "Qt"


def platform_name(environ: dict | None = None) -> str:
    """The platform plugin Qt will try first: QT_QPA_PLATFORM's, else wayland or xcb as Qt picks."""
    env = os.environ if environ is None else environ
    chosen = env.get("QT_QPA_PLATFORM", "").split(";")[0].split(":")[0].strip()
    if chosen:
        return chosen
    if env.get("WAYLAND_DISPLAY") and env.get("XDG_SESSION_TYPE") == "wayland":
        return "wayland"
    return "xcb"


def missing_libraries(binary: Path) -> list[str]:
    """The sonames the dynamic loader cannot find for `binary` ([] when ldd is absent)."""
    ldd = shutil.which("ldd")
    if ldd is None or not binary.is_file():
        return []
    out = subprocess.run([ldd, str(binary)], capture_output=True, text=True, timeout=30).stdout
    return sorted(set(_NOT_FOUND.findall(out)))


def _binaries(platform: str) -> list[Path]:
    qt = qt_dir()
    if qt is None:
        return []
    gui = sorted((qt / "lib").glob("libQt6Gui.so*"))[:1]
    return gui + [qt / "plugins" / "platforms" / f"libq{platform}.so"]


def missing_for(platform: str) -> list[str]:
    """Missing sonames for QtGui and one platform plugin."""
    return sorted({lib for b in _binaries(platform) for lib in missing_libraries(b)})


def packages(sonames: list[str]) -> list[str]:
    """The Debian packages that provide `sonames` (unknown ones are left out)."""
    return sorted({DEBIAN_PACKAGES[s] for s in sonames if s in DEBIAN_PACKAGES})


def install_command(sonames: list[str]) -> str:
    """The one command that installs what is missing (Debian), or what to look for elsewhere."""
    pkgs = packages(sonames)
    unknown = [s for s in sonames if s not in DEBIAN_PACKAGES]
    cmd = f"sudo apt-get install -y {' '.join(pkgs)}" if pkgs else ""
    if unknown:
        cmd += (" and " if cmd else "") + f"the packages that provide {', '.join(unknown)}"
    return cmd


def startup_problem(environ: dict | None = None) -> str:
    """Why Qt cannot start its window here, with the fix ("" when nothing is missing)."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return ""  # macOS and Windows wheels bring their platform plugin's libraries along
    platform = platform_name(env)
    if platform == "xcb" and not env.get("DISPLAY"):
        return ("No display: DISPLAY is not set. Start PrefixLab from a desktop session, or run it "
                "without a window with QT_QPA_PLATFORM=offscreen.")
    missing = missing_for(platform)
    if not missing:
        return ""
    return (f"Qt's '{platform}' platform cannot load: {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing.\nInstall with:\n  {install_command(missing)}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--packages" in args:  # everything for both the offscreen and the xcb platform
        print(" ".join(packages(sorted(set(missing_for("offscreen")) | set(missing_for("xcb"))))))
        return 0
    problem = startup_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
