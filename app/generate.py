"""`prefixlab generate`: stream one answer to the terminal."""

from __future__ import annotations

import sys
import time

import engine as dl
from engine.chat import chat_prompt, turn_messages
from engine.sampler import Sampler

from .common_args import add_model_arg, add_sampling_args, load_model_or_exit, sampling_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream one answer to the terminal")
    add_model_arg(p)
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--prompt", required=True, help="user message")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        params = sampling_from_args(args)
    except ValueError as e:
        raise SystemExit(f"prefixlab generate: {e}") from None
    if args.max_new < 1:
        raise SystemExit("prefixlab generate: --max-new must be >= 1")
    m = load_model_or_exit(getattr(args, "model", None))
    if args.raw:
        prompt = m.tokenizer.encode_prompt(args.prompt)  # with the BOS a model like Gemma wants
    else:
        prompt = chat_prompt(m.tokenizer, turn_messages(args.system, args.prompt))
    pool = dl.create_kv_pool(m)
    s = dl.create_session(m, pool)
    sampler, stream = Sampler(params), m.tokenizer.stream()
    t0 = time.perf_counter()
    logits = dl.eval(m, s, prompt)
    ttft = time.perf_counter() - t0
    generated: list[int] = []
    try:
        while len(generated) < args.max_new:
            token = sampler.sample(logits, prompt + generated)
            if token in m.tokenizer.eos_ids:
                break
            generated.append(token)
            sys.stdout.write(stream.step(token))
            sys.stdout.flush()
            if s.n_past + 1 >= m.config.context_length:
                break
            logits = dl.eval(m, s, [token])
    except KeyboardInterrupt:
        pass
    dt = time.perf_counter() - t0 - ttft
    dl.release_kv_pages(s)
    rate = (len(generated) - 1) / dt if len(generated) > 1 and dt > 0 else 0.0
    print(f"\n[{len(prompt)} prompt tokens, ttft {ttft * 1e3:.0f} ms, {len(generated)} tokens, "
          f"{rate:.1f} tok/s]", file=sys.stderr)
    return 0
