"""Who may start a live feed on the web UI's server (app/live_sessions.py asks, under its lock).

A closed tab stays closed: a late event of its page (a camera frame after its unload) is a
UIError, not a feed that nobody would close (`check_open`; the last CLOSED_KEPT closed sessions
are remembered). Past the server's `max_feeds` (a silent camera not counted: `over_limit`) a new
feed is a UIError too (`check_room`), said in the activity log once per page and kind until it
gets room: a refused camera goes on sending a frame every 0.1 s, each one refused.
"""

from __future__ import annotations

from collections import OrderedDict

from app import activity
from app.errors import UIError
from app.inflight_share import MAX_FEEDS, over_limit

CLOSED_KEPT = 10_000  # closed sessions remembered, so that a late event cannot bring one back


class FeedGate:
    def __init__(self, max_feeds: int = MAX_FEEDS):
        self.max_feeds = max_feeds
        self._closed: OrderedDict[str, None] = OrderedDict()  # the sessions closed last, oldest first
        self._refused: set[tuple[str, str]] = set()  # (session, kind) refused for max_feeds, said once

    def check_open(self, session: str) -> None:
        if session in self._closed:
            raise UIError("this page was closed: reload it")

    def full(self, feeds: dict, key: tuple[str, str]) -> str | None:
        """Why a new feed at `key` may not start now (None: it may), logged once until it may."""
        full = over_limit(feeds, key, self.max_feeds)
        said = key in self._refused
        if full:
            if len(self._refused) >= CLOSED_KEPT:  # API clients' sessions are never closed: bounded
                self._refused.clear()
            self._refused.add(key)
            if not said:
                activity.refused(key, full)
        else:
            self._refused.discard(key)
        return full

    def check_room(self, feeds: dict, key: tuple[str, str]) -> None:
        full = self.full(feeds, key)
        if full:
            raise UIError(full)

    def close(self, session: str) -> None:
        """The session's tab is gone: none of its events starts a feed again."""
        self._closed[session] = None
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
        self._refused.difference_update({(session, "pull"), (session, "push")})
