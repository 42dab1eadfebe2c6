"""One palette for page states and chart series, in a light and a dark theme."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QWidget

from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED, PAGE_STATE_NAMES

# Stacking order of the pool chart (bottom to top) and the page-map legend.
STATE_ORDER = (PAGE_PRIVATE, PAGE_SHARED, PAGE_CACHED, PAGE_FREE)
STATE_LABELS = {
    PAGE_PRIVATE: "private to streams",
    PAGE_SHARED: "shared (cache + streams)",
    PAGE_CACHED: "held only by the cache",
    PAGE_FREE: "free",
}

# Okabe-Ito hues (colour-blind safe), mid-tone so they read on white and on near-black.
# Green always means "the cache helped", vermillion "computed / missed".
_STATE_COLORS = {PAGE_PRIVATE: "#3d85c6", PAGE_SHARED: "#1fa774", PAGE_CACHED: "#e69f00"}
_FREE_LIGHT, _FREE_DARK = "#d9dee5", "#3a404a"

SERIES_COLORS = {
    "pages_private": _STATE_COLORS[PAGE_PRIVATE],
    "pages_shared": _STATE_COLORS[PAGE_SHARED],
    "pages_cached": _STATE_COLORS[PAGE_CACHED],
    "chains": "#8e6bd8",
    "cached_pages": _STATE_COLORS[PAGE_CACHED],
    "hits": "#3d85c6",
    "disk_hits": "#7a5c2e",
    "hit_rate": "#cc5fa0",
    "prefill_computed": "#d55e00",
    "prefill_saved": "#1fa774",
    "ttft_hit": "#1fa774",
    "ttft_miss": "#d55e00",
    "ttft_no_cache": "#8c959f",  # an estimate: grey, drawn hollow and dashed beside the hit
}


# Where the prompt tokens went (docs/design.md §15), in the order a card's bar and the chart
# stack them: greens for what the cache gave, amber for near misses, vermillion and purple for
# what a cause took, grey for what nothing earlier had.
PART_COLORS = {
    "cached": "#1fa774",    # pool pages (disk: loaded back from the disk tier, darker)
    "disk": "#137052",
    "lent": "#56b4e9",      # borrowed from the pass computing them
    "cap": "#a6d8c3",       # held back so the model evaluates one token
    "rounding": "#e69f00",  # shared, but not a whole page
    "evicted": "#d55e00",
    "isolated": "#8e6bd8",  # another namespace had them
    "new": "#8c959f",
}
PART_WORDS = {
    "cached": "cached (pool pages)", "disk": "cached from the disk tier", "lent": "lent (same pass)",
    "cap": "cap (last token computed)", "rounding": "rounding (part of a page)",
    "evicted": "evicted before this request", "isolated": "isolated (another namespace had them)",
    "new": "new (nothing earlier had them)",
}


@dataclass(frozen=True)
class Theme:
    """Colours of one theme, as '#rrggbb' strings."""

    dark: bool
    background: str   # plot and page-map background
    foreground: str   # titles, legend text
    muted: str        # axis ticks, secondary text
    grid: str         # grid lines and cell gaps
    highlight: str    # outline of the selected chain's pages
    hover: str        # outline of the page under the mouse
    prompt_bg: str    # the prompt's differing token, in rich text
    cached_bg: str    # the cached token it differs from

    def color(self, name: str) -> QColor:
        return QColor(getattr(self, name))


LIGHT = Theme(dark=False, background="#ffffff", foreground="#1f2328", muted="#59636e", grid="#d0d7de",
              highlight="#111111", hover="#6e7781", prompt_bg="#ffd8c2", cached_bg="#cdeedd")
DARK = Theme(dark=True, background="#1e2127", foreground="#e6e6e6", muted="#a3acb9", grid="#3b4250",
             highlight="#ffffff", hover="#9aa4b2", prompt_bg="#7a3413", cached_bg="#155a38")


def is_dark(palette: QPalette | None = None) -> bool:
    """True when the palette's window colour is dark."""
    if palette is None:
        palette = QGuiApplication.palette()
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


def theme_for(source: QWidget | QPalette | str | None = None) -> Theme:
    """The theme matching a widget's palette, a palette, or 'light' / 'dark' by name."""
    if isinstance(source, str):
        if source not in ("light", "dark"):
            raise ValueError(f"theme must be 'light' or 'dark', got {source!r}")
        return DARK if source == "dark" else LIGHT
    palette = source.palette() if isinstance(source, QWidget) else source
    if palette is None:
        palette = QGuiApplication.palette()
    dark = is_dark(palette)
    base = DARK if dark else LIGHT
    # Blend into the host window: take its own background and text colours.
    window = palette.color(QPalette.ColorRole.Base)
    if dark and window.lightness() <= palette.color(QPalette.ColorRole.Window).lightness():
        window = palette.color(QPalette.ColorRole.Window).lighter(118)  # a card a shade above the window
    text = palette.color(QPalette.ColorRole.WindowText)
    return Theme(dark=dark, background=window.name(), foreground=text.name(), muted=base.muted,
                 grid=base.grid, highlight=base.highlight, hover=base.hover, prompt_bg=base.prompt_bg,
                 cached_bg=base.cached_bg)


def state_color(state: int, theme: Theme) -> QColor:
    """Colour of a page state (PAGE_FREE/PRIVATE/SHARED/CACHED) in a theme."""
    if state == PAGE_FREE:
        return QColor(_FREE_DARK if theme.dark else _FREE_LIGHT)
    return QColor(_STATE_COLORS[state])


def state_name(state: int) -> str:
    return PAGE_STATE_NAMES[state]


def series_color(name: str, theme: Theme | None = None) -> QColor:
    """Colour of a chart series; 'pages_free' follows the theme."""
    if name == "pages_free":
        return state_color(PAGE_FREE, theme or LIGHT)
    return QColor(SERIES_COLORS[name])


def with_alpha(color: QColor, alpha: int) -> QColor:
    c = QColor(color)
    c.setAlpha(alpha)
    return c
