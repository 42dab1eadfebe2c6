"""`prefixlab advise TRACE`: what the hosted APIs' prompt caches make of this traffic, and why."""

from __future__ import annotations

import json

from ..common_args import add_model_arg
from ..replay.trace import TraceError
from .rules import DEFAULT_RULES, RulesError


def add_parser(sub) -> None:
    p = sub.add_parser("advise", help="what hosted APIs' prompt caches hit on a trace, why not, and a fix",
                       description=__doc__)
    p.add_argument("trace", help="chat-log JSONL (OpenAI bodies, one per line), a `prefixlab proxy` "
                                 "recording, or a prefixlab token trace (a session's)")
    p.add_argument("--rules", metavar="NAME,...|FILE",
                   help=f"rule sets: shipped names ({', '.join(DEFAULT_RULES)}) and/or TOML files "
                        "(default: every shipped one)")
    p.add_argument("--json", metavar="OUT.json", help="write the whole advice here")
    p.add_argument("--report", metavar="OUT.html", help="write the advice as an HTML page here")
    p.add_argument("--strict", action="store_true",
                   help="refuse the trace at its first bad line or request (default: skip it, count and "
                        "report it)")
    add_model_arg(p)  # prompts are tokenized with this model's chat template and tokenizer
    p.set_defaults(func=run)


def _tokenizer_loader(name: str):
    from engine import ModelLoadError, load_model
    try:
        return load_model(name).tokenizer
    except (ModelLoadError, OSError) as e:
        raise ValueError(f"cannot load tokenizer {name!r}: {e}") from None


def run(args) -> int:
    """Print the advice; write JSON / HTML when asked. Bad input exits with a message."""
    from ..common_args import load_model_or_exit
    from ..report.files import ReportWriteError, write_bytes
    from .advisor import Tokenizers, advise
    from .html import render_html
    from .rules import resolve_rules
    from .traffic import read_traffic
    try:
        rule_sets = resolve_rules(args.rules)
        skipped: list = []
        requests = read_traffic(args.trace, skipped, strict=args.strict)
    except (RulesError, TraceError) as e:
        raise SystemExit(f"prefixlab advise: {e}") from None
    model = load_model_or_exit(getattr(args, "model", None))
    from .hints import hints
    try:
        toks = Tokenizers(model.tokenizer, _tokenizer_loader)
        advice = advise(args.trace, requests, rule_sets, toks, skipped, strict=args.strict)
        dropped = {k["line"] for k in advice["skipped"]}  # requests a template could not render
        rendered = [r for r in requests if r.line not in dropped]
        advice["hints"] = hints(advice, rule_sets, rendered, toks.prompts)
    except ValueError as e:
        raise SystemExit(f"prefixlab advise: {args.trace}, {e}") from None
    print(summary(advice))
    try:
        if args.json:
            # strict JSON: a figure that is not finite fails here rather than writing Infinity
            write_bytes(args.json, json.dumps(advice, indent=1, ensure_ascii=False, allow_nan=False).encode())
            print(f"wrote {args.json}")
        if args.report:
            write_bytes(args.report, render_html(advice).encode())
            print(f"wrote {args.report}")
    except (ReportWriteError, ValueError) as e:
        raise SystemExit(f"prefixlab advise: {e}") from None
    return 0


def summary(advice: dict) -> str:
    """The text the command prints: totals per rule set, the largest groups, the what-if."""
    from .html import (
        ERROR_HEAD,
        TOTALS_HEAD,
        WHATIF_HEAD,
        error_rows,
        provider_notes,
        totals_rows,
        whatif_rows,
    )
    skipped = advice["skipped"]
    lines = [f"skipped line {k['line']}: {k['why']}" for k in skipped[:5]]
    if len(skipped) > 5:
        lines.append(f"... and {len(skipped) - 5} more skipped lines")
    if skipped:
        lines.append(f"{len(skipped):,} line(s) skipped in all; --strict refuses the trace instead")
    lines.append(_table(TOTALS_HEAD, totals_rows(advice)))
    lines += [f"{rs['rules']['name']}: {line}" for rs in advice["rule_sets"] for line in provider_notes(rs)
              if not line.startswith("not modelled")]
    if advice.get("hints"):
        lines += ["", "The change that pays most, per provider:"]
        lines += [f"  {name}: {line}" for name, line in advice["hints"].items()]
    measured = error_rows(advice, limit=10)
    if measured:
        lines += ["", "Predicted against the upstream's cached tokens (first requests):",
                  _table(ERROR_HEAD, measured)]
    lines.append("")
    groups = advice["groups"]
    lines += [g["summary"] + f" (e.g. {g['example']['text']!r})" for g in groups[:5]] or \
        ["No request departs from an earlier one."]
    if advice["what_if"]:
        lines += ["", f"What if you {advice['what_if']['fix']}:", _table(WHATIF_HEAD, whatif_rows(advice))]
    return "\n".join(lines)


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join(line(r) for r in [head, *rows])
