"""The model bar: name, architecture, quantization, parameters, context; a busy bar while loading."""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QProgressBar, QPushButton, QSizePolicy

from .format import format_bytes, format_count
from .theme import icon

# first dropped when space runs short
_DROP_ORDER = ("size", "kv", "budget", "context", "params", "arch", "quant")
MIN_WIDTH = 320


def _chip(tooltip: str) -> QLabel:
    label = QLabel()
    label.setProperty("chip", True)
    label.setToolTip(tooltip)
    return label


class WholeTextLabel(QLabel):
    """Its words whole or not at all: the space left beside the chips clipped "loaded in
    0.31 s" to "lo" (the tooltip keeps the details either way)."""

    _whole = ""

    def set_whole_text(self, text: str) -> None:
        self._whole = text
        self._fit()

    def _fit(self) -> None:
        fits = self.fontMetrics().horizontalAdvance(self._whole) <= self.width()
        self.setText(self._whole if fits else "")

    def resizeEvent(self, e) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(e)
        self._fit()


class ModelBar(QFrame):
    """Shows the loaded model; while a load runs, a busy indicator and the file being loaded."""

    open_clicked = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("modelBar")
        self.info: dict | None = None
        lay = QHBoxLayout(self)
        lay.setContentsMargins(8, 0, 4, 0)
        lay.setSpacing(6)
        self.name = QLabel("No model")
        self.name.setObjectName("modelName")
        self.name.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.name)
        self.chips = {
            "arch": _chip("Architecture"), "quant": _chip("Quantization of the weights"),
            "params": _chip("Parameters"), "context": _chip("Context length (tokens)"),
            "size": _chip("File size"),
            "kv": _chip("KV pages: the dtype their K and V are stored in, and the bytes one page takes "
                        "(every layer's K and V for its positions)"),
            "budget": _chip("The KV budget: memory for the pool's pages"),
            "template": _chip("The model's chat template could not be used"),
        }
        for chip in self.chips.values():
            chip.hide()
            lay.addWidget(chip)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)  # busy: a load reports no fraction
        self.progress.setFixedWidth(140)
        self.progress.setTextVisible(False)
        self.progress.hide()
        lay.addWidget(self.progress)
        self.status = WholeTextLabel()
        self.status.setObjectName("hint")
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        lay.addWidget(self.status, 1)
        self.open_button = QPushButton(icon("open"), "Open model…")
        self.open_button.setToolTip("Open a GGUF model (Ctrl+O), or drop a .gguf file on the window")
        self.open_button.clicked.connect(self.open_clicked)
        lay.addWidget(self.open_button)

    @property
    def loading(self) -> bool:
        return not self.progress.isHidden()

    def set_loading(self, what: str) -> None:
        self.progress.show()
        self.status.set_whole_text(f"Loading {what}…")
        self.open_button.setEnabled(False)

    def set_model(self, info: dict) -> None:
        """Show a loaded model (a dict from app.model_info.model_info)."""
        self.info = info
        self.progress.hide()
        self.open_button.setEnabled(True)
        self.name.setText(info["name"])
        self.name.setToolTip(info["path"])
        self.chips["arch"].setText(info["arch"])
        self.chips["quant"].setText(info["quant"])
        self.chips["quant"].setToolTip(info.get("quant_mix", ""))
        self.chips["arch"].setToolTip(info.get("description", ""))
        self.chips["params"].setText(f"{format_count(info['n_params'])} params")
        self.chips["params"].setToolTip(f"{info['n_params']:,} parameters")
        self.chips["context"].setText(f"ctx {info['context_length']:,}")
        self.chips["size"].setText(format_bytes(info["file_size"]))
        warning = info.get("template_warning", "")
        self.chips["template"].setText("⚠ Gemma turn template" if "Gemma" in warning
                                       else "⚠ plain ChatML template")
        self.chips["template"].setToolTip(warning)
        self.chips["template"].setVisible(bool(warning))  # before the fit: it measures the bar
        self._fit_chips()
        how = "from the prepared weight image" if info.get("from_image") else "from the GGUF"
        self.status.set_whole_text(f"loaded in {info['load_seconds']:.2f} s")
        self.status.setToolTip(
            f"{info['file']} — {info['n_layers']} layers, d={info['d_model']}, {info['n_heads']} heads "
            f"({info['n_kv_heads']} KV), vocab {info['vocab_size']:,}; loaded {how}")

    def set_kv_pages(self, dtype: str, bytes_per_page: int) -> None:
        """The KV pool's page dtype and size, e.g. "KV float16 · 360 KiB/page" (from a snapshot)."""
        chip = self.chips["kv"]
        text = f"KV {dtype} · {bytes_per_page / 1024:,.0f} KiB/page" if bytes_per_page else ""
        if text != chip.text():
            chip.setText(text)
            chip.setVisible(bool(text) and self.info is not None)
            self._fit_chips()

    def set_kv_budget(self, budget_bytes: int, line: str) -> None:
        """The KV budget the pool runs under: "KV ≤ 2.3 GiB", its whole line in the tip
        ("KV budget 2.35 GiB (10% of RAM): 3,190 pages"; the pool grows without one)."""
        chip = self.chips["budget"]
        chip.setText(f"KV ≤ {format_bytes(budget_bytes)}" if budget_bytes else "KV unbounded")
        chip.setToolTip(f"{line}\nRunning requests and the prefix cache share these pages; the cache gives "
                        "back its least recently used pages when they run short. Settings → Pool pages "
                        "sets your own")
        chip.setVisible(self.info is not None)
        self._fit_chips()

    def _fit_chips(self) -> None:
        """Drop the least needed chips until the bar fits its width (a 1280-pixel window's toolbar
        otherwise hid the whole bar, model name included)."""
        if self.info is None:
            return
        for key in _DROP_ORDER:
            self.chips[key].setVisible(bool(self.chips[key].text()))
        for key in _DROP_ORDER:
            if self.layout().minimumSize().width() <= self.width():
                break
            self.chips[key].setVisible(False)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt's name
        # Name and Open button; chips come and go with the width (_fit_chips).
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), MIN_WIDTH), hint.height())

    def resizeEvent(self, e) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(e)
        self._fit_chips()

    def set_failed(self) -> None:
        """A load failed: stop the busy bar; the previous model's details stay."""
        self.progress.hide()
        self.open_button.setEnabled(True)
        self.status.set_whole_text("load failed; kept the previous model" if self.info else "no model loaded")

    def summary(self) -> str:
        """One line: name, architecture, quantization, parameters, context (tests and reports)."""
        if not self.info:
            return "no model"
        i = self.info
        return (f"{i['name']} · {i['arch']} · {i['quant']} · {format_count(i['n_params'])} params · "
                f"ctx {i['context_length']}")
