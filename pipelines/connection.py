"""How a live source's connection holds up (`Connection`): network streams and cameras alike.

A live source goes through "connecting", "live", "reconnecting" after a break, and ends
"ended" or "failed". Each break is an outage, said when it begins and when it ends (`on_event`,
called from the reading thread: a run of hours shows an outage when it happens, not in its
closing figures), and said to go on after a minute, then at doubling gaps. Between tries to
reopen, the source waits with exponential backoff. A source that never sent a frame is an error
after `max_wait` seconds (a wrong address, a camera that is not there); one that did is
reopened for as long as it takes (a camera rebooting is gone a minute or two, a network outage
longer), or for `max_outage` seconds where that is given. Each outage is also handed, as an
`Outage` (outage.py), to `on_outage`: when it is found, when frames come again and when it is
given up, for the outputs that mark it (a live log's line, a recording's card).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .frame import SourceSilent
from .outage import Outage, span

TIMED_OUT = "nothing came for"  # FFmpeg's "Immediate exit requested", in the words a user needs
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 4.0  # the pause before the first try to reopen, and the longest
TRY_MIN_S = 0.5  # the shortest open or read timeout a try is given, however little time the source has left
STILL_SAID_S = (60.0, 1800.0)  # an outage is said to go on after a minute, then at doubling gaps up to 30 min


class Connection:
    def __init__(self, display: str, max_wait: float, max_outage: float | None = None):
        self.display, self.max_wait, self.max_outage = display, max_wait, max_outage
        self.on_event: Callable[[str], None] | None = None
        self.on_outage: Callable[[Outage], None] | None = None
        self.outage: Outage | None = None  # the one going on (until a frame comes, or it is given up)
        self.counters: Callable[[], dict] | None = None  # the source's own figures, for `health`
        self.state = "connecting"
        self.since = time.perf_counter()  # when the state began (an outage: at the last frame)
        self.outages = 0  # times frames stopped coming (each may take several tries to reopen)
        self.last_frame: float | None = None
        self.last_reason: str | None = None  # why the last try to (re)open failed: a run that ends meanwhile says it
        self.delay = RETRY_FIRST_S
        self._still_at = STILL_SAID_S[0]  # seconds into an outage at which it is next said to go on
        self._stopped = threading.Event()
        # When the consumer will stop (perf_counter; `live --duration`): no try to open outlasts it
        # (a UDP stream that never came held `--duration 1` 5 s past its end, in its open timeout).
        self.ends_at: float | None = None

    def stop(self) -> None:
        """The consumer is gone (a viewer pressed Stop): a source in an outage stops retrying (its
        thread would otherwise try a dead camera for ever)."""
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def pause(self, seconds: float) -> None:
        """Wait, unless (or until) the consumer is gone."""
        if seconds > 0:
            self._stopped.wait(seconds)

    def frame(self) -> None:
        """A frame came."""
        self.last_frame, self.delay = time.perf_counter(), RETRY_FIRST_S
        if self.state != "live":
            if self.state == "reconnecting":
                self.say(f"back after {span(self.last_frame - self.since)}")
                if self.outage is not None:
                    self._tell(self.outage.closed(self.last_frame))
            self.set("live")
            self._still_at = STILL_SAID_S[0]

    def lost(self, reason: str) -> None:
        """Frames stopped coming (the source is about to be reopened)."""
        if self.state == "live":
            self.say(f"lost ({reason}); reconnecting")
            self.set("reconnecting", since=self.last_frame)  # the outage began with the last frame
            self.outages += 1
            self._tell(Outage(self.display, self.last_frame, reason))

    def retry(self, reason: str, started: float) -> bool:
        """Wait before the next try to reopen; False if `stop` came meanwhile (the source ends).
        Raise a SourceSilent once the source has sent nothing for longer than it may (`check`)."""
        self.last_reason = reason
        self.check(reason, started)
        silent = time.perf_counter() - (self.last_frame or started)
        if self.last_frame is not None and silent >= self._still_at:
            timed_out = reason.startswith(TIMED_OUT)  # the reason says how long already
            self.say(f"still reconnecting: nothing for {span(silent)}" + ("" if timed_out else f" ({reason})"))
            self._still_at = min(2 * self._still_at, self._still_at + STILL_SAID_S[1])
        left = self.remaining(started)
        if self._stopped.wait(self.delay if left is None else min(self.delay, max(0.0, left))):
            return False
        self.delay = min(self.delay * 2, RETRY_MAX_S)
        return True

    def check(self, reason: str, started: float) -> None:
        """Raise a SourceSilent if the source has sent nothing for longer than it may (`started`:
        when this source was first opened): `max_wait` before its first frame, `max_outage`
        after; `reason`: why the last try to (re)open failed, or why frames stopped."""
        silent = time.perf_counter() - (self.last_frame or started)
        limit = self.max_wait if self.last_frame is None else self.max_outage
        if limit is None or silent <= limit:
            return
        if self.last_frame is None:
            raise SourceSilent(f"cannot read {self.display}: {reason}")
        if self.outage is not None:
            self._tell(self.outage.given_up(time.perf_counter()))
        # Said as given up: "cannot read X: nothing came for 4.0 s" read as a try that failed,
        # in a run that went on with its other sources
        raise SourceSilent(f"gave up on {self.display}: no frame for {span(silent)}, more than the "
                           f"{span(limit)} allowed" + ("" if reason.startswith(TIMED_OUT) else f" (the last try: {reason})"))

    def try_timeouts(self, open_timeout: float, read_timeout: float, started: float | None) -> tuple[float, float]:
        """A try's open and read timeouts (a stream's, StreamSource). A try that would outlast the
        time the source has left ends with it: the last one ran its whole open timeout past the
        limit (a server that never answers: said after 38 s of 30). So do its reads, cut to the
        time left before the source is given up (not to the run's end: a read is never waited for
        then); and once the source has sent frames (--max-outage), the open leaves its read that
        time too. A hung camera answers every try, its open taking its whole timeout, then sends
        nothing: it was given up an open and a read timeout past --max-outage (9.5 s of 4, 13 s of
        10). If frames come again through such a try, its reads keep their shorter timeout: a
        pause that long is then an outage. Each is TRY_MIN_S at least."""
        left = None if started is None else self.remaining(started)
        timeout = open_timeout if left is None else min(open_timeout, max(TRY_MIN_S, left))
        read = read_timeout if self.max_outage is None else min(read_timeout, self.max_outage)
        give_up = None if started is None else self.give_up_in(started)
        if give_up is not None:
            read = min(read, max(TRY_MIN_S, give_up))
            if self.last_frame is not None:
                timeout = min(timeout, max(TRY_MIN_S, give_up - read))
                read = min(read, max(TRY_MIN_S, give_up - timeout))
        return timeout, read

    def give_up_in(self, started: float) -> float | None:
        """Seconds before this source is given up (`check`'s limit, from `started` or its last
        frame); None where it never is."""
        limit = self.max_wait if self.last_frame is None else self.max_outage
        return None if limit is None else limit - (time.perf_counter() - (self.last_frame or started))

    def remaining(self, started: float) -> float | None:
        """Seconds before this source is given up (`give_up_in`) or its consumer stops
        (`ends_at`), whichever is sooner; None where neither is."""
        left = self.give_up_in(started)
        if self.ends_at is not None:
            end = self.ends_at - time.perf_counter()
            left = end if left is None else min(left, end)
        return left

    def set(self, state: str, since: float | None = None) -> None:
        self.state, self.since = state, time.perf_counter() if since is None else since

    def _tell(self, outage: Outage) -> None:
        """`outage` is the news: kept while it goes on, and handed to `on_outage`."""
        self.outage = None if outage.over else outage
        if self.on_outage is not None:
            self.on_outage(outage)

    def say(self, line: str) -> None:
        if self.on_event is not None:
            self.on_event(line)

    def why_nothing(self) -> str | None:
        """For a run that ends before this source sent a frame: why it had not (Connection
        refused), or None."""
        return self.last_reason if self.last_frame is None else None

    def health(self) -> dict:
        """The state, for how many seconds, the outages so far, why the last try to (re)open failed
        while it is still trying ("reason"), and the source's `counters`."""
        trying = self.state in ("connecting", "reconnecting") and self.last_reason is not None
        return {"state": self.state, "for_s": round(time.perf_counter() - self.since, 1), "outages": self.outages,
                **({"reason": self.last_reason} if trying else {}),
                **(self.counters() if self.counters is not None else {})}
