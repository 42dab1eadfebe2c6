"""A test's ear on an EngineLoop: one sink for every job it submits (a job's sink is the only
way its events come back), read whole or one step at a time."""

from __future__ import annotations

from engine.loop import EngineLoop


class Heard:
    """Every event of the jobs submitted through it, in order."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)

    def submit(self, **chat_args) -> int:
        """`EngineLoop.submit_now` with this sink; the request id."""
        return self.loop.submit_now(self, **chat_args)

    def step(self) -> list:
        """One loop step; the events it sent."""
        n = len(self.events)
        self.loop.step()
        return self.events[n:]
