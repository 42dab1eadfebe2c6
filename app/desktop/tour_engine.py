"""The guided tour's engine work: "The Prefix Cache by Hand", step by step, on the real engine.

Two streams on their own small pool and cache (the app's scheduler is left alone): A prefills
a system prompt and a question, donates its full pages to the cache and releases them; B asks
another question, attaches the cached pages and prefills only its tail; then the teardown.
Each step returns the numbers its caption shows, read back from the engine. The object also
offers what engine.snapshot.SnapshotMaker reads from a scheduler (pool, cache, streams,
timeline, records), so the window's page map, chains table and charts draw the tour.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import engine as dl
from engine.estimates import ttft_without_cache
from engine.metrics import RequestRecord, Timeline, page_states, timeline_row

PAGE_ROWS = 16
A, B = 1, 2  # the two streams' request ids, as the page map and the TTFT chart show them


@dataclass
class _Stream:
    """What SnapshotMaker reads of a stream: its id and its session (None once released)."""

    id: int
    session: dl.Session | None


def _chain_words(chains) -> str:
    return "[" + ", ".join(f"#{c.id}: {c.n_tokens} tokens, {c.pages_live} pages live, {c.hits} hit(s)"
                           for c in chains) + "]"


class TourEngine:
    """The tutorial's pool, cache and two streams; `run(step)` does one step and returns its facts.

    Each step also returns `code`: the tutorial's calls it made, with their real arguments and
    what they returned; `python_script()` turns the steps so far into a script for a terminal.
    """

    STEPS = ("intro", "prefill_a", "donate_a", "release_a", "attach_b", "prefill_b", "chains", "teardown")

    def __init__(self, model: dl.Model, system: str, question_a: str, question_b: str,
                 page_rows: int = PAGE_ROWS):
        self.model = model
        self.pool = dl.create_kv_pool(model, page_rows=page_rows)
        self.cache = dl.create_prefix_cache(max_pages=0)
        self.texts = {A: self._prompt_text(system, question_a), B: self._prompt_text(system, question_b)}
        self.prompts = {rid: dl.encode(model, text) for rid, text in self.texts.items()}
        self.calls: list[tuple[str, str, object]] = []  # (step, call, what it returned or None)
        self._running = ""  # the step whose calls are being noted
        self.questions = {A: question_a, B: question_b}
        self._streams = {A: _Stream(A, None), B: _Stream(B, None)}
        self._records: dict[int, RequestRecord] = {}
        self.timeline = Timeline()
        self.prefill_computed = 0
        self.prefill_saved = 0
        self.prefill_seconds = 0.0
        self._clock = 0.0  # engine seconds so far (the charts' time axis)
        self._warm()

    def _prompt_text(self, system: str, question: str) -> str:
        """System prompt + one question in the model's chat template (the scheduler's first turn),
        as text whose `dl.encode` is the prompt's ids (a BOS the model wants is written out)."""
        tok = self.model.tokenizer
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tok.render_chat(messages, add_generation_prompt=True)
        ids = tok.encode_prompt(text)
        if dl.encode(self.model, text) != ids:
            text = tok.decode(ids[:len(tok.prompt_prefix_ids)]) + text
        return text

    def shared_chars(self) -> int:
        """How many characters A's and B's prompt texts share from the start (for highlighting)."""
        a, b = self.texts[A], self.texts[B]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def _call(self, call: str, result=None):
        """Note one tutorial call this step made (and what it returned); return the result."""
        self.calls.append((self._running, call, result))
        return result

    def code(self, step: str) -> list[str]:
        """A step's calls as the tutorial writes them: `dl.prefix_attach(cache, pool, s_b, p_b)  # -> 80`."""
        return [call if result is None else f"{call}  # -> {result}"
                for name, call, result in self.calls if name == step]

    def python_script(self, model_path: str) -> str:
        """The steps run so far as a script for a terminal, on the public API (`import engine as dl`):
        each call that returned something prints it, beside what the tour got."""
        lines = ["import engine as dl", "", f"m = dl.load_model({model_path!r})",
                 f"PROMPT_A = {self.texts[A]!r}", f"PROMPT_B = {self.texts[B]!r}"]
        for name in self.STEPS:
            calls = [(c, r) for n, c, r in self.calls if n == name]
            if calls:
                lines += ["", f"# {name}"]
            for call, result in calls:
                if result is None:
                    lines.append(call)
                else:
                    lines.append(f"print({call})  # the tour: {result}")
        return "\n".join(lines) + "\n"

    def _warm(self) -> None:
        # One throwaway token, as the tutorial does: A's time is then prefill, not first-touch costs.
        s = dl.create_session(self.model, self.pool)
        dl.eval(self.model, s, self.prompts[A][:1])
        dl.release_kv_pages(s)

    # what SnapshotMaker reads ---------------------------------------------------------------
    def page_states(self):
        return page_states(self.pool, self.cache)

    def streams(self) -> list[_Stream]:
        return [s for s in self._streams.values() if s.session is not None]

    def records(self) -> list[RequestRecord]:
        """A's and B's records (the TTFT chart draws them), as Scheduler.records() gives its own."""
        return list(self._records.values())

    def record(self, rid: int) -> RequestRecord:
        return self._records[rid]

    def session(self, rid: int) -> dl.Session | None:
        """Stream `rid`'s session (None before it starts and once released)."""
        return self._streams[rid].session

    def prefill_rate(self) -> float:
        """Prefill tokens per second measured on this tour's prefills."""
        return self.prefill_computed / self.prefill_seconds if self.prefill_seconds else 0.0

    def seconds_saved(self) -> float:
        rate = self.prefill_rate()
        return self.prefill_saved / rate if rate else 0.0

    # the steps ------------------------------------------------------------------------------
    def run(self, step: str) -> dict:
        """Do one step of the tutorial; return its facts (numbers read back from the engine)."""
        t0 = time.perf_counter()
        self._running = step
        facts = getattr(self, f"_{step}")()
        step_s = time.perf_counter() - t0
        # The tour's clock runs only while the engine works: a person reading a caption between
        # steps would otherwise stretch the charts into one long flat line.
        self._clock += step_s
        self.timeline.append(timeline_row(
            self.pool, self.cache, step=len(self.timeline) + 1, wall_s=self._clock,
            prefill_computed=self.prefill_computed, prefill_saved=self.prefill_saved, decode_tokens=0,
            active=len(self.streams()), queued=0, batch_size=len(self.streams()),
            step_s=step_s))
        return {**facts, "step": step, "pages_in_use": self.pool.num_used_pages,
                "capacity": self.pool.capacity, "page_rows": self.pool.page_rows, "code": self.code(step)}

    def _intro(self) -> dict:
        self._call(f"pool = dl.create_kv_pool(m, page_rows={self.pool.page_rows})")
        self._call("cache = dl.create_prefix_cache(max_pages=0)")
        for name, rid in (("a", A), ("b", B)):
            self._call(f"p_{name} = dl.encode(m, PROMPT_{name.upper()})")
            self._call(f"len(p_{name})", len(self.prompts[rid]))
        return {"n_prompt_a": len(self.prompts[A]), "n_prompt_b": len(self.prompts[B])}

    def _prefill(self, rid: int, tokens: list[int], call: str) -> float:
        s = self._streams[rid].session
        t0 = time.perf_counter()
        dl.eval(self.model, s, tokens)
        secs = time.perf_counter() - t0
        self._call(call)
        self._call(f"s_{'ab'[rid - A]}.n_past", s.n_past)
        self.prefill_computed += len(tokens)
        self.prefill_seconds += secs
        r = self._records[rid]
        r.n_prefilled, r.ttft_s = len(tokens), secs
        return secs

    def _prefill_a(self) -> dict:
        p = self.prompts[A]
        self._streams[A].session = s = dl.create_session(self.model, self.pool)
        self._call("s_a = dl.create_session(m, pool)")
        self._records[A] = RequestRecord(A, self.questions[A], None, "", len(p),
                                        submitted_s=self._clock)
        secs = self._prefill(A, p, "logits = dl.eval(m, s_a, p_a)")
        return {"n_prompt": len(p), "pages": len(s.page_table), "seconds": secs,
                "full_pages": len(p) // self.pool.page_rows}

    def _donate_a(self) -> dict:
        s = self._streams[A].session
        added = dl.prefix_insert(self.cache, self.pool, s, self.prompts[A], "tour: the system prompt")
        self._call('dl.prefix_insert(cache, pool, s_a, p_a, "tour: the system prompt")', int(added))
        self._records[A].chain_donated = dl.prefix_chain_list(self.cache)[-1].id if added else None
        return {"added": added, "tokens": added * self.pool.page_rows, "n_past": s.n_past,
                "held": dl.prefix_held_groups(self.cache)}

    def _release_a(self) -> dict:
        before = self.pool.num_used_pages
        dl.release_kv_pages(self._streams[A].session)
        self._call("dl.release_kv_pages(s_a)")
        self._streams[A].session = None
        self._records[A].finish_reason = "stop"
        self._call("dl.prefix_held_groups(cache)", dl.prefix_held_groups(self.cache))
        return {"held": dl.prefix_held_groups(self.cache), "returned": before - self.pool.num_used_pages,
                "free": self.pool.num_free_pages}

    def _attach_b(self) -> dict:
        p = self.prompts[B]
        self._streams[B].session = s = dl.create_session(self.model, self.pool)
        self._records[B] = RequestRecord(B, self.questions[B], None, "", len(p),
                                        submitted_s=self._clock)
        self._call("s_b = dl.create_session(m, pool)")
        matched = dl.prefix_attach(self.cache, self.pool, s, p)
        self._call("dl.prefix_attach(cache, pool, s_b, p_b)", matched)
        # where B's prompt tokens went (docs/design.md §15), as the scheduler would account them
        account, _ = self.cache.account(p, "", n_cached=matched // self.pool.page_rows)
        self._records[B].parts, self._records[B].diverged_at = account.parts, account.diverged_at
        self.prefill_saved += matched
        self._records[B].n_cached = matched
        refs = {int(page): int(self.pool.refcount[page]) for page in s.page_table}
        return {"matched": matched, "n_prompt": len(p), "matched_pages": len(s.page_table),
                "refcounts": refs, "parts": account.parts.as_dict(), "diverged_at": account.diverged_at}

    def _prefill_b(self) -> dict:
        s = self._streams[B].session
        tail = self.prompts[B][s.n_past:]
        secs = self._prefill(B, tail, f"logits = dl.eval(m, s_b, p_b[{s.n_past}:])  # {len(tail)} tokens")
        rate = self.prefill_rate()  # the session's, as the TTFT chart's estimate uses it
        return {"tail": len(tail), "seconds": secs, "n_prompt": len(self.prompts[B]),
                "whole_estimate": ttft_without_cache(secs, len(self.prompts[B]) - len(tail), rate),
                "pages": len(s.page_table)}

    def _chains(self) -> dict:
        chains = [{"id": c.id, "n_tokens": c.n_tokens, "pages_live": c.pages_live, "hits": c.hits}
                  for c in dl.prefix_chain_list(self.cache)]
        held = [int(p) for p in dl.prefix_held_pages(self.cache)]
        self._call("dl.prefix_chain_list(cache)", _chain_words(dl.prefix_chain_list(self.cache)))
        self._call("dl.prefix_held_pages(cache)", held)
        shared = [p for p in held if self.pool.refcount[p] > 1]
        return {"chains": chains, "held": held, "shared": shared}

    def _teardown(self) -> dict:
        dl.release_kv_pages(self._streams[B].session)
        self._call("dl.release_kv_pages(s_b)")
        self._streams[B].session = None
        self._records[B].finish_reason = "stop"
        released = dl.prefix_release(self.cache, self.pool)
        self._call("dl.prefix_release(cache, pool)", released)
        self.pool.check()
        self._call("pool.num_used_pages", self.pool.num_used_pages)
        return {"released": released}
