"""The one rule every hook vLLM calls follows: a failure of the connector is a miss and a
recompute for the engine, never an exception in vLLM's step and never a block the engine reads
that the daemon did not write.

Each hook runs its body under :meth:`Guard.run` with a fallback that says what a failure means
there, whatever raised (the daemon's refusal, a lost or malformed connection, an ``OSError``, a
bug in the connector's own bookkeeping):

- a lookup that fails is no hit (0 external tokens), and the leases it holds are returned;
- external tokens vLLM accepted and the step does not load are reported as failed blocks
  (``get_block_ids_with_load_errors``), so vLLM recomputes them instead of reading them;
- a load that fails reports its blocks the same way;
- a store that fails is dropped (a future miss);
- bookkeeping that fails (a release, a report of finished requests) is tried again later.

A fallback that cannot make the failure safe raises, and the exception reaches vLLM: an engine
that stops is better than one that reads KV nobody wrote. :class:`EngineStateUnknown` is never
caught: it says the engine's own objects may no longer agree (KV tensors half moved), which no
fallback of the connector can repair. Failures are logged through a :class:`Throttle`, with the
traceback where the failure is not the daemon's (it may be a bug).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from tierkv.errors import DaemonError
from tierkv.vllm.link import Unavailable
from tierkv.vllm.throttle import INTERVAL_S, Throttle

T = TypeVar("T")


class EngineStateUnknown(RuntimeError):
    """A failure that may have left the engine's own objects inconsistent: never swallowed."""


def nothing(_error: Exception) -> None:
    """The fallback of a body whose failure needs nothing done but the log."""
    return None


class Guard:
    """Runs hook bodies, turning their failures into their fallbacks' answers."""

    def __init__(self, log: logging.Logger, interval_s: float = INTERVAL_S) -> None:
        self.throttle = Throttle(log, interval_s)
        #: Failures caught so far (each one logged or counted in the next warning).
        self.failures = 0

    def run(self, what: str, body: Callable[[], T], fallback: Callable[[Exception], T]) -> T:
        """``body()``; if it raises (anything but :class:`EngineStateUnknown` and what is not an
        ``Exception``), the failure is logged under ``what`` and ``fallback(error)`` answers.
        ``what`` names a kind of failure, not one request's: it is the key the warnings are
        throttled by."""
        try:
            return body()
        except EngineStateUnknown:
            raise
        except Exception as error:
            self.failures += 1
            the_daemons = isinstance(error, (Unavailable, DaemonError))
            self.throttle.warning(
                what,
                "tierkv: %s failed (%s: %s)",
                what,
                type(error).__name__,
                error,
                exc_info=None if the_daemons else error,
            )
            return fallback(error)
