"""Options shared by the headless commands: the model, sampling and scheduler settings."""

from __future__ import annotations

import argparse

from engine import ModelLoadError, ModelNotInstalled, SamplingParams, load_model


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    d = SamplingParams()
    g.add_argument("--max-new", type=int, default=128, help="most tokens to generate per answer")
    g.add_argument("--temp", type=float, default=d.temperature, help="temperature (0: greedy)")
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--min-p", type=float, default=d.min_p)
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    g.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n)
    g.add_argument("--seed", type=int, default=None)


def sampling_from_args(args) -> SamplingParams:
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                            seed=args.seed)
    params.validate()
    return params


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=argparse.SUPPRESS,
                   help="GGUF model file or built-in name (smollm2-135m, gemma3-270m; "
                        "default: the bundled SmolLM2-135M-Instruct)")


def load_model_or_exit(path: str | None):
    """Load the model (a file or a built-in name, installed on demand), or say why and exit (status 2)."""
    try:
        return load_model(path)
    except ModelNotInstalled as e:
        from .builtin_models import offer_install
        try:
            if offer_install(e.model):
                return load_model_or_exit(path)
        except RuntimeError as failed:
            raise SystemExit(f"prefixlab: {failed}") from None
        raise SystemExit(f"prefixlab: cannot load model: {e}") from None
    except ModelLoadError as e:
        raise SystemExit(f"prefixlab: cannot load model: {e}") from None
