"""The `prefixlab` command: the desktop app by default, or generate / run / bench / serve / replay."""

from __future__ import annotations

import argparse
import importlib
import sys

import engine

# command -> the module whose add_parser(sub) registers it. Only the command being run is
# imported: the others' parsers pull in the trace readers, the report and ZeroMQ (~40 ms
# of every `prefixlab run` start).
COMMANDS = {"generate": "generate", "run": "run_headless", "bench": "bench", "models": "builtin_models",
            "replay": "replay.cli", "watch": "watch.cli", "serve": "serve.cli",
            "advise": "advise.cli", "proxy": "proxy.cli", "calibrate": "replay.calibrate"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or with only `command` when it is one of them."""
    parser = argparse.ArgumentParser(prog="prefixlab", description=__doc__)
    parser.add_argument("--model", help="GGUF model file or built-in name (smollm2-135m, gemma3-270m; "
                                        "default: the bundled SmolLM2-135M-Instruct)")
    sub = parser.add_subparsers(dest="command")
    for name, module in COMMANDS.items():
        if command not in COMMANDS or command == name:
            importlib.import_module(f".{module}", __package__).add_parser(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The command word of argv (skipping the top-level --model and its value)."""
    rest = iter(argv)
    for word in rest:
        if word == "--model":
            next(rest, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    engine.tune_process()  # before any command's imports load NumPy (engine/tuning.py)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command(argv)).parse_args(argv)
    if args.command is None:
        from .desktop.gui import run_app
        return run_app(model_path=args.model)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
