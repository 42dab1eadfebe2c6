"""`wait_until`: the tests' one poll-until-deadline loop."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, what: str | Callable[[], str] = "",
               step: Callable[[], object] | None = None, interval: float = 0.02,
               ignore: tuple[type[BaseException], ...] = ()):
    """Call `predicate` until it returns something true (returned) or `timeout` s pass (AssertionError).

    Between tries it calls `step()` (e.g. a watcher's poll) or sleeps `interval`. `what` names
    the awaited condition in the failure (a callable is asked only then); exceptions in `ignore`
    count as "not yet" (a server that does not accept connections yet).
    """
    end = time.monotonic() + timeout
    while True:
        try:
            result = predicate()
        except ignore:
            result = None
        if result:
            return result
        if time.monotonic() >= end:
            awaited = what() if callable(what) else what or "it"
            raise AssertionError(f"waited {timeout:g} s in vain for {awaited}")
        if step is not None:
            step()
        else:
            time.sleep(interval)
