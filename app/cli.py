"""The `prefixlab` command: the desktop app by default, or generate / run / bench / serve / replay."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixlab", description=__doc__)
    parser.add_argument("--model", help="GGUF model file or built-in name (smollm2-135m, gemma3-270m; "
                                        "default: the bundled SmolLM2-135M-Instruct)")
    sub = parser.add_subparsers(dest="command")
    from . import bench, builtin_models, generate, run_headless
    from .replay import cli as replay_cli
    generate.add_parser(sub)
    run_headless.add_parser(sub)
    bench.add_parser(sub)
    builtin_models.add_parser(sub)
    replay_cli.add_parser(sub)
    from .watch import cli as watch_cli
    watch_cli.add_parser(sub)
    from .serve import cli as serve_cli
    serve_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        from .gui import run_app
        return run_app(model_path=args.model)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
