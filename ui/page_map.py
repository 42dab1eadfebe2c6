"""Every page of the KV pool as one cell coloured by state, painted in one image (no widget per cell)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import numpy as np
from PySide6.QtCore import QBuffer, QByteArray, QEvent, QIODevice, QPoint, QRect, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QImage, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from engine.metrics import PAGE_CACHED, PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED, PAGE_STATE_NAMES
from engine.snapshot import PageInfo, Snapshot

from .colors import STATE_ORDER, Theme, state_color, theme_for

MAX_CELL = 32        # in the widget; images for reports may use bigger cells
MAX_IMAGE_CELL = 40
MIN_CELL = 2
LABEL_CELL = 18      # cells at least this big show their reference count
LEGEND_H = 24
SUMMARY_H = 18       # the line under a map that shows part of the pool
READABLE_CELL = 10   # the smallest cell a person can point at and tell the colour of
MARGIN = 6
STATE_WORDS = {
    PAGE_FREE: "free",
    PAGE_PRIVATE: "private (streams only)",
    PAGE_SHARED: "shared (cache + streams)",
    PAGE_CACHED: "cached (cache only, evictable)",
}


@dataclass(frozen=True)
class GridGeometry:
    """Where the cells go: cell size, gap, columns and rows, from the grid's top-left corner."""

    cell: int
    gap: int
    cols: int
    rows: int

    @property
    def pitch(self) -> int:
        return self.cell + self.gap

    def cell_rect(self, page: int, origin: QPoint) -> QRect:
        row, col = divmod(page, self.cols)
        return QRect(origin.x() + col * self.pitch, origin.y() + row * self.pitch, self.cell, self.cell)

    @property
    def size(self) -> QSize:
        return QSize(max(0, self.cols * self.pitch - self.gap), max(0, self.rows * self.pitch - self.gap))


def fit_grid(n: int, width: int, height: int, max_cell: int = MAX_CELL) -> GridGeometry:
    """The largest cells (MIN_CELL..max_cell) that fit n cells in width x height, wrapping rows."""
    n = max(n, 1)
    for cell in range(max_cell, MIN_CELL - 1, -1):
        gap = 2 if cell >= 9 else 1
        cols = max(1, (width + gap) // (cell + gap))
        rows = math.ceil(n / cols)
        if rows * (cell + gap) - gap <= height:
            return GridGeometry(cell, gap, cols, rows)
    cols = max(1, (width + 1) // (MIN_CELL + 1))
    return GridGeometry(MIN_CELL, 1, cols, math.ceil(n / cols))  # clipped at the bottom


def grid_image(colors: np.ndarray, geo: GridGeometry, background: QColor) -> QImage:
    """An RGBA image of the cells: colors is uint8[n, 4], one row per page, in page order."""
    size = geo.size
    w, h = size.width(), size.height()
    if w <= 0 or h <= 0:
        return QImage()
    p = geo.pitch
    cy, oy = np.divmod(np.arange(h), p)
    cx, ox = np.divmod(np.arange(w), p)
    inside_y, inside_x = oy < geo.cell, ox < geo.cell
    idx = cy[:, None] * geo.cols + cx[None, :]
    mask = inside_y[:, None] & inside_x[None, :] & (idx < len(colors))
    if geo.cell >= 6:  # cut the corner pixels: slightly rounded cells
        edge_y = (oy == 0) | (oy == geo.cell - 1)
        edge_x = (ox == 0) | (ox == geo.cell - 1)
        mask &= ~(edge_y[:, None] & edge_x[None, :])
    img = np.empty((h, w, 4), dtype=np.uint8)
    img[...] = (background.red(), background.green(), background.blue(), background.alpha())
    img[mask] = colors[idx[mask]]
    qimg = QImage(img.data, w, h, 4 * w, QImage.Format.Format_RGBA8888)
    return qimg.copy()  # own the pixels: `img` dies with this frame


@dataclass(frozen=True)
class MapView:
    """What the map draws: `count` pages from page `first`, laid out by `geo` from `origin`."""

    geo: GridGeometry
    origin: QPoint
    first: int
    count: int

    def index(self, page: int) -> int | None:
        """The page's cell number in this view, or None when it is not drawn."""
        i = page - self.first
        return i if 0 <= i < self.count else None


class PageMap(QWidget):
    """One cell per pool page coloured free/private/shared/cached, with a legend and tooltips.

    A pool too large to draw at a readable cell size (the default KV budget makes ~3,400 pages)
    shows the region in use at a readable size and sums up the rest in a line under it; the
    wheel pans over the rest, Ctrl+wheel zooms, a double click fits again.
    """

    page_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMouseTracking(True)
        self.setMinimumSize(240, 110)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self._states = np.zeros(0, dtype=np.int8)
        self._refcounts = np.zeros(0, dtype=np.int64)
        self._pages: dict[int, PageInfo] = {}
        self._page_rows = 0
        self._chain: int | None = None
        self._highlight: np.ndarray = np.zeros(0, dtype=np.int64)
        self._hover: int | None = None
        self._cache_key = None
        self._cache_img = QImage()
        self._first_row = 0          # the pan: the first row of cells drawn
        self._zoom: int | None = None  # a cell size the wheel chose; None: fit the region in use

    # data -------------------------------------------------------------
    def set_snapshot(self, snapshot: Snapshot) -> None:
        """Show a snapshot's pool: states, reference counts and the per-page details."""
        self.set_pages(snapshot.page_states, snapshot.refcounts, snapshot.pages, snapshot.page_rows)

    update_snapshot = set_snapshot

    def set_pages(self, states: np.ndarray, refcounts: np.ndarray | None = None,
                  pages: dict[int, PageInfo] | None = None, page_rows: int = 0) -> None:
        """Show page states (PAGE_* per page) with optional reference counts and page details."""
        self._states = np.asarray(states, dtype=np.int8).copy()
        self._refcounts = (np.asarray(refcounts, dtype=np.int64).copy() if refcounts is not None
                           else np.zeros(len(self._states), dtype=np.int64))
        self._pages = dict(pages or {})
        self._page_rows = page_rows
        if self._hover is not None and self._hover >= len(self._states):
            self._hover = None
        self._update_highlight()
        self._cache_key = None
        self.update()

    def clear(self) -> None:
        self.set_pages(np.zeros(0, dtype=np.int8))

    def counts_by_state(self) -> dict[str, int]:
        """Pages per state: keys free, private, shared, cached."""
        counts = np.bincount(self._states.astype(np.int64), minlength=4) if len(self._states) else np.zeros(4)
        return {PAGE_STATE_NAMES[s]: int(counts[s]) for s in (PAGE_FREE, PAGE_PRIVATE, PAGE_SHARED,
                                                               PAGE_CACHED)}

    @property
    def page_count(self) -> int:
        return len(self._states)

    def highlight_chain(self, chain_id: int | None) -> None:
        """Outline the pages of one chain (None: no outline)."""
        self._chain = chain_id
        self._update_highlight()
        self.update()

    def highlighted_chain(self) -> int | None:
        return self._chain

    def highlighted_pages(self) -> list[int]:
        """The pages outlined now, ascending."""
        return [int(p) for p in self._highlight]

    def _update_highlight(self) -> None:
        if self._chain is None:
            self._highlight = np.zeros(0, dtype=np.int64)
            return
        self._highlight = np.array(sorted(p for p, info in self._pages.items() if info.chain_id == self._chain
                                          and p < len(self._states)), dtype=np.int64)

    # tooltips ---------------------------------------------------------
    def tooltip_for(self, page: int) -> str:
        """Rich text describing one page; every text from the model is HTML-escaped."""
        if not 0 <= page < len(self._states):
            return ""
        state = int(self._states[page])
        info = self._pages.get(page)
        ref = int(self._refcounts[page]) if page < len(self._refcounts) else 0
        color = state_color(state, theme_for("light")).name()
        rows = [("reference count", str(ref)), ("state", html.escape(STATE_WORDS[state]))]
        if info is not None:
            rows.append(("chain", f"#{info.chain_id}" if info.chain_id is not None else "none (not cached)"))
            owners = ", ".join(f"#{o}" for o in info.owners) if info.owners else "none"
            rows.append(("owners (requests)", html.escape(owners)))
            if info.first_position is not None:
                last = info.first_position + max(self._page_rows, 1) - 1
                rows.append(("positions", f"{info.first_position}–{last}" if self._page_rows
                             else str(info.first_position)))
            if getattr(info, "read_by", ""):  # sliding-window models (Gemma 3)
                rows.append(("read by", html.escape(info.read_by)))
        body = "".join(f"<tr><td style='color:#6e7781;padding-right:8px'>{k}</td><td>{v}</td></tr>"
                       for k, v in rows)
        text = ""
        if info is not None and info.text:
            text = ("<div style='margin-top:4px;color:#6e7781'>tokens:</div>"
                    f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(info.text)}</pre>")
        return (f"<div style='min-width:220px'><b><span style='color:{color}'>■</span> page {page}</b>"
                f"<table cellspacing='0' cellpadding='1'>{body}</table>{text}</div>")

    def page_at(self, pos: QPoint) -> int | None:
        """The page under a widget position, or None."""
        view = self._view(self.rect())
        geo = view.geo
        x, y = pos.x() - view.origin.x(), pos.y() - view.origin.y()
        if x < 0 or y < 0:
            return None
        col, ox = divmod(x, geo.pitch)
        row, oy = divmod(y, geo.pitch)
        if col >= geo.cols or ox >= geo.cell or oy >= geo.cell:
            return None
        i = row * geo.cols + col
        return view.first + i if i < view.count else None

    def cell_rect(self, page: int) -> QRect:
        """Where a page's cell is drawn in the widget (an empty rect when it is not drawn now)."""
        view = self._view(self.rect())
        i = view.index(page)
        return QRect() if i is None else view.geo.cell_rect(i, view.origin)

    def shown_pages(self) -> range:
        """The pages drawn now (all of them, or the region in use and what the pan shows)."""
        view = self._view(self.rect())
        return range(view.first, view.first + view.count)

    def wheelEvent(self, e) -> None:  # noqa: N802 - Qt's name
        steps = e.angleDelta().y() // 120
        if not steps:
            return super().wheelEvent(e)
        view = self._view(self.rect())
        if e.modifiers() & Qt.KeyboardModifier.ControlModifier:  # zoom
            self._zoom = max(MIN_CELL, min(MAX_CELL, view.geo.cell + 2 * steps))
        else:  # pan by rows
            self._first_row = max(0, view.first // max(view.geo.cols, 1) - 3 * steps)
        self._cache_key = None
        self.update()
        e.accept()

    def mouseDoubleClickEvent(self, e) -> None:  # noqa: N802 - Qt's name
        self._first_row, self._zoom = 0, None  # fit the region in use again
        self._cache_key = None
        self.update()
        super().mouseDoubleClickEvent(e)

    def event(self, e: QEvent) -> bool:
        if e.type() == QEvent.Type.ToolTip:
            page = self.page_at(e.pos())
            if page is None:
                QToolTip.hideText()
                e.ignore()
            else:
                QToolTip.showText(e.globalPos(), self.tooltip_for(page), self, self.cell_rect(page))
            return True
        return super().event(e)

    def mouseMoveEvent(self, e) -> None:  # noqa: N802 - Qt's name
        page = self.page_at(e.position().toPoint())
        if page != self._hover:
            self._hover = page
            self.update()
        super().mouseMoveEvent(e)

    def leaveEvent(self, e) -> None:  # noqa: N802
        if self._hover is not None:
            self._hover = None
            self.update()
        super().leaveEvent(e)

    def mousePressEvent(self, e) -> None:  # noqa: N802
        if e.button() == Qt.MouseButton.LeftButton:
            page = self.page_at(e.position().toPoint())
            if page is not None:
                self.page_clicked.emit(page)
        super().mousePressEvent(e)

    # painting ---------------------------------------------------------
    def sizeHint(self) -> QSize:  # noqa: N802
        return QSize(420, 220)

    def _view(self, rect: QRect, max_cell: int = MAX_CELL) -> MapView:
        """The whole pool when it fits at a readable cell size (or the wheel zoomed out to it);
        else the region in use (up to the last page not free) at the largest readable cells,
        from the panned row, with a summary line under it."""
        area = rect.adjusted(MARGIN, MARGIN + LEGEND_H, -MARGIN, -MARGIN)
        n = len(self._states)
        whole = fit_grid(n, area.width(), area.height(), max_cell)
        if self._zoom is None and whole.cell >= READABLE_CELL:
            return MapView(whole, area.topLeft(), 0, n)
        area.setBottom(area.bottom() - SUMMARY_H)
        if self._zoom is not None:
            cell = self._zoom
        else:
            used = np.flatnonzero(self._states != PAGE_FREE)
            region = int(used[-1]) + 1 if len(used) else 1
            cell = max(READABLE_CELL, fit_grid(region, area.width(), area.height(), max_cell).cell)
        gap = 2 if cell >= 9 else 1
        cols = max(1, (area.width() + gap) // (cell + gap))
        rows = max(1, (area.height() + gap) // (cell + gap))
        if cols * rows >= n:  # zoomed out far enough to see it all
            return MapView(GridGeometry(cell, gap, cols, math.ceil(n / cols)), area.topLeft(), 0, n)
        last_row = max(0, math.ceil(n / cols) - rows)
        first = min(self._first_row, last_row) * cols
        count = min(n - first, cols * rows)
        return MapView(GridGeometry(cell, gap, cols, math.ceil(count / cols)), area.topLeft(), first, count)

    def summary(self, view: MapView | None = None) -> str:
        """The line under a partial map: which pages it shows and what the rest hold."""
        view = view or self._view(self.rect())
        n = len(self._states)
        if view.count >= n:
            return ""
        hidden = np.concatenate([self._states[:view.first], self._states[view.first + view.count:]])
        in_use = int(np.count_nonzero(hidden != PAGE_FREE))
        rest = f"{len(hidden) - in_use:,} free pages" + (f" and {in_use:,} in use" if in_use else "")
        return (f"pages {view.first:,}–{view.first + view.count - 1:,} of {n:,}; {rest} not drawn "
                "(wheel: scroll, Ctrl+wheel: zoom, double click: fit)")

    def _colors(self, theme: Theme) -> np.ndarray:
        lut = np.zeros((4, 4), dtype=np.uint8)
        for s in range(4):
            c = state_color(s, theme)
            lut[s] = (c.red(), c.green(), c.blue(), 255)
        return lut[self._states.astype(np.int64)]

    def paint_to(self, painter: QPainter, rect: QRect, theme: Theme, cached: bool = False,
                 max_cell: int = MAX_CELL) -> None:
        """Draw legend, grid and outlines into rect (the widget and render_image share this)."""
        painter.fillRect(rect, theme.color("background"))
        self._paint_legend(painter, rect, theme)
        if not len(self._states):
            painter.setPen(theme.color("muted"))
            painter.drawText(rect.adjusted(0, LEGEND_H, 0, 0), Qt.AlignmentFlag.AlignCenter,
                             "No pool yet: the map fills in when the engine runs.")
            return
        view = self._view(rect, max_cell)
        geo, origin = view.geo, view.origin
        shown = slice(view.first, view.first + view.count)
        key = (self._states.tobytes(), geo, view.first, view.count, theme)
        if cached and key == self._cache_key:
            img = self._cache_img
        else:
            img = grid_image(self._colors(theme)[shown], geo, theme.color("background"))
            if cached:
                self._cache_key, self._cache_img = key, img
        painter.drawImage(origin, img)
        if view.count < len(self._states):
            painter.setPen(theme.color("muted"))
            painter.drawText(QRect(rect.left() + MARGIN, rect.bottom() - MARGIN - SUMMARY_H + 1,
                                   rect.width() - 2 * MARGIN, SUMMARY_H),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft,
                             QFontMetrics(painter.font()).elidedText(
                                 self.summary(view), Qt.TextElideMode.ElideRight, rect.width() - 2 * MARGIN))
        if geo.cell >= LABEL_CELL:
            self._paint_refcounts(painter, view, theme)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        if len(self._highlight):
            pen = QPen(theme.color("highlight"))
            pen.setWidth(2 if geo.cell >= 6 else 1)
            painter.setPen(pen)
            outset = 1 if geo.cell >= 6 else 0
            for page in self._highlight:
                i = view.index(int(page))
                if i is not None:
                    rect_i = geo.cell_rect(i, origin)
                    painter.drawRect(rect_i.adjusted(-outset, -outset, outset - 1, outset - 1))
        hover = view.index(self._hover) if self._hover is not None else None
        if hover is not None and cached:
            painter.setPen(QPen(theme.color("hover"), 1))
            painter.drawRect(geo.cell_rect(hover, origin).adjusted(-1, -1, 0, 0))

    def _paint_refcounts(self, painter: QPainter, view: MapView, theme: Theme) -> None:
        """The reference count inside each page in use (only when cells are big, so only a few)."""
        font = QFont(painter.font())
        font.setPixelSize(max(8, int(view.geo.cell * 0.45)))
        painter.setFont(font)
        shown = self._states[view.first:view.first + view.count]
        for i in np.flatnonzero(shown != PAGE_FREE)[:4096]:
            page = view.first + int(i)
            ref = int(self._refcounts[page]) if page < len(self._refcounts) else 0
            bg = state_color(int(self._states[page]), theme)
            painter.setPen(QColor("#ffffff") if bg.lightness() < 170 else QColor("#1f2328"))
            painter.drawText(view.geo.cell_rect(int(i), view.origin), Qt.AlignmentFlag.AlignCenter, str(ref))

    def _paint_legend(self, painter: QPainter, rect: QRect, theme: Theme) -> None:
        font = QFont(painter.font())
        font.setPointSizeF(max(8.0, font.pointSizeF() * 0.95))
        painter.setFont(font)
        fm = QFontMetrics(font)
        counts = self.counts_by_state()
        x = rect.left() + MARGIN
        y = rect.top() + MARGIN
        box = 10
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        for state in STATE_ORDER:
            name = PAGE_STATE_NAMES[state]
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(state_color(state, theme))
            painter.drawRoundedRect(QRectF(x, y + (LEGEND_H - 8 - box) / 2, box, box), 2, 2)
            x += box + 5
            label = f"{name} {counts[name]:,}"
            painter.setPen(theme.color("foreground"))
            painter.drawText(QRect(x, y, fm.horizontalAdvance(label) + 2, LEGEND_H - 8),
                             Qt.AlignmentFlag.AlignVCenter, label)
            x += fm.horizontalAdvance(label) + 14
        total = f"{len(self._states):,} pages"
        if self._page_rows:
            total += f" × {self._page_rows} positions"
        w = fm.horizontalAdvance(total) + 2
        if x + w < rect.right() - MARGIN:
            painter.setPen(theme.color("muted"))
            painter.drawText(QRect(rect.right() - MARGIN - w, y, w, LEGEND_H - 8),
                             Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight, total)

    def paintEvent(self, e) -> None:  # noqa: N802
        painter = QPainter(self)
        try:
            self.paint_to(painter, self.rect(), theme_for(self), cached=True)
        finally:
            painter.end()

    def changeEvent(self, e: QEvent) -> None:  # noqa: N802
        if e.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):
            self._cache_key = None
            self.update()
        super().changeEvent(e)

    def render_image(self, width: int = 900, height: int = 360, theme: str | None = "light") -> bytes:
        """PNG bytes of the map at width x height (theme None: the widget's own)."""
        img = QImage(int(width), int(height), QImage.Format.Format_ARGB32)
        painter = QPainter(img)
        try:
            painter.setFont(self.font())
            self.paint_to(painter, img.rect(), theme_for(theme) if theme else theme_for(self),
                          max_cell=MAX_IMAGE_CELL)
        finally:
            painter.end()
        return png_bytes(img)


def png_bytes(image) -> bytes:
    """PNG bytes of a QImage or QPixmap."""
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buf, "PNG")
    buf.close()
    return bytes(data)
