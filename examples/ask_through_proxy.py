"""A tiny application for the README's proxy example: three questions through `prefixlab proxy`.

Its system prompt starts with the time, as many do, so `prefixlab advise` has something to
find. Set OPENAI_BASE_URL to the proxy (pip install openai).
"""

from __future__ import annotations

import datetime
import os
import time

from openai import APIConnectionError, APIStatusError, OpenAI

QUESTIONS = ("What glue works on wood?", "Which paint suits a bathroom?", "Do you sell rakes?")
POLICY = ("You are the assistant of Hillside Hardware, a small store for tools, paint, lumber and garden "
          "supplies. Answer in one short sentence, name the aisle, and never invent prices. ") * 36


def main() -> None:
    client = OpenAI(api_key=os.environ.get("OPENAI_API_KEY", "sk-example"), max_retries=0)
    deadline = time.monotonic() + 300
    while True:  # the server loads its model first (503 meanwhile)
        try:
            client.models.list()
            break
        except (APIStatusError, APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    for q in QUESTIONS:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        r = client.chat.completions.create(
            model="gpt-4o", temperature=0, max_tokens=12,
            messages=[{"role": "system", "content": f"Current time: {now}. {POLICY}"},
                      {"role": "user", "content": q}])
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        print(f"{q} -> {r.choices[0].message.content!r} ({cached} of {r.usage.prompt_tokens} prompt "
              f"tokens cached)")
        time.sleep(1.1)  # a new second: a new timestamp


if __name__ == "__main__":
    main()
