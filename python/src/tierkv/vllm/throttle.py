"""Warnings at most once a minute per kind, so that a daemon that stays down does not flood vLLM's
log with one line per request or per step."""

from __future__ import annotations

import logging
import threading
import time

#: The least time between two warnings of one kind, in seconds.
INTERVAL_S = 60.0


class Throttle:
    """Logs each kind of warning (a key) at most once per ``interval_s``; the ones left out go to
    the debug log, and the next warning of that kind says how many there were."""

    def __init__(self, log: logging.Logger, interval_s: float = INTERVAL_S) -> None:
        self._log = log
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warning(
        self, key: str, message: str, *args: object, exc_info: BaseException | None = None
    ) -> bool:
        """Logs ``message % args`` as a warning unless one of ``key`` was logged less than the
        interval ago (then at debug level, without the traceback); whether it was a warning."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._left_out[key] = self._left_out.get(key, 0) + 1
                left_out = None
            else:
                self._last[key] = now
                left_out = self._left_out.pop(key, 0)
        if left_out is None:
            self._log.debug(message, *args)
            return False
        if left_out:
            message += " (%d more like it since the last warning)"
            args = (*args, left_out)
        self._log.warning(message, *args, exc_info=exc_info)
        return True
