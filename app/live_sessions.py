"""The web UI's live feeds, one set per browser tab: what a tab's Live and Camera tabs run.

A tab is a session id. It owns at most one pulled feed (a file, stream or webcam on the server)
and one pushed feed (its browser's camera), each with at most one recording; the last feed of
each kind it stopped stays for its Export. Closing the tab stops both feeds, cancels its video
jobs and removes its recordings, and a closed tab stays closed: a late event of its page is a
UIError, not a new feed. Every open feed gets an equal share of the engine's frames in flight, but
a camera that stopped sending (CAMERA_SILENT_S without a frame) holds none until it sends again
(app/inflight_share.py). A new feed beyond the server's max_feeds, or from a closed tab, is a UIError
(app/feed_gate.py).

The feeds run on their `Service`'s engine, settings and reading, under the service's lock: a
model reload (`Service.apply`) and a Start that opens its source meanwhile must see each other
(the Start installs its feed only on the engine it was built on). Every user mistake raises
`UIError` with a one-line message for the page.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app import activity, live_exports
from app.errors import UIError
from app.feed_gate import FeedGate
from app.inflight_share import MAX_FEEDS, latest_answer_s, share_inflight, silent
from app.samples import SAMPLES_DIR, sample_videos

if TYPE_CHECKING:
    from app.service import Service

LIVE_FPS = 60.0
# A live recording (the Live tab's Record box) keeps the first this many seconds: ~1 MB a minute
# at 640x360 (the 60 fps sample: 2.8 MB for 150 s). One per tab, replaced by its next one,
# removed with the tab.
RECORD_MAX_S = 600.0
# Sessions whose stopped feeds and recordings stay for their Export and download, least recently
# stopped dropped first: an API client without Gradio's heartbeat never unloads, and each of its
# calls, a session, had kept its stopped feed (~5 MB) and recording until the server stopped.
STOPPED_KEPT = 32


class LiveSessions:
    def __init__(self, service: Service, lock: threading.RLock, max_feeds: int = MAX_FEEDS):
        """lock: the service's own, held by its engine's reload too (see the module's docstring)."""
        self._service = service
        self._lock = lock
        self._gate = FeedGate(max_feeds)  # closed tabs and the server's limit (app/feed_gate.py)
        self._feeds: dict[tuple[str, str], object] = {}  # (session, "pull" | "push") -> LiveFeed
        self._ended: dict[tuple[str, str], object] = {}  # the last stopped feed of each, for an export
        self._recorders: dict[tuple[str, str], object] = {}  # (session, "pull" | "push") -> its feed's Recorder
        self._cam_record: dict[str, bool] = {}  # session -> its camera's Record box, as last seen
        self._starting: dict[str, threading.Lock] = {}  # session -> held while a Start of it runs
        self._stopped: OrderedDict[str, None] = OrderedDict()  # sessions with a feed stopped, least recent first

    def start_live(self, session: str, source: str, task: dict, record: bool = False,
                   name: str | None = None) -> object:
        """Start (or restart) this session's live feed from a sample name, file path, URL or webcam
        index; with `record`, its completed frames are recorded (`recording()` gives the MP4).
        `name`: what its Export calls a file (an upload by its own name; else its path)."""
        source = (source or "").strip()
        if not source:
            raise UIError("choose a source")
        # One Start of a session at a time: a double click runs two, and without this both stopped
        # the old feed, both started one, and the feed installed first played on for nobody (its
        # source round and round), with its recording on the same file as the other's. Per
        # session, so that a slow network source delays no other viewer's Start.
        with self._lock:
            self._check_open(session)
            starting = self._starting.setdefault(session, threading.Lock())
        with starting:
            # A close_session that came between the two found no feed to stop: one started now
            # would play on for nobody.
            with self._lock:
                self._check_open(session)
            return self._start_live(session, source, task, record, name)

    def _start_live(self, session: str, source: str, task: dict, record: bool, name: str | None = None) -> object:
        from pipelines.feed import LiveFeed
        from pipelines.recorder import Recorder
        from pipelines.sources import open_live
        from pipelines.webcam import parse_webcam

        service = self._service
        self.stop_live(session, why="a new Start")
        self._check_room((session, "pull"))  # before the source is opened: a refusal costs nothing
        if source in sample_videos():
            source = str(SAMPLES_DIR / source)
        try:
            missing = parse_webcam(source) is None and "://" not in source and not Path(source).is_file()
            folder = missing and Path(source).is_dir()
        except OSError as e:  # a name past the file system's limit: its [Errno 36] repeated it whole
            from engine.errors import shortened

            raise UIError(f"no such file: {shortened(source)} ({e.strerror})") from None
        if missing:  # a listed file by its name (the server's path is not the page's to see), an upload by its own
            shown = name or source
            raise UIError(f"{shown} is a folder, not a video" if folder else f"no such file: {shown}")
        live = open_live(source, reading=service.reading, name=name)  # a recording (a file, or one over the network) plays as if live, round and round
        recorder = None
        if record:
            self._drop_recording(session, "pull")
            recorder = Recorder(service.jobs.recording_path("live"), max_seconds=RECORD_MAX_S)
            if live.connection is not None:  # a stream's outages marked in it, as `live --annotate` marks them
                live.connection.on_outage = recorder.outage
        engine = service.engine()
        try:
            feed = LiveFeed(engine, task, service.params(), live.frames, realtime=live.paced, loop=live.loops,
                            fps=LIVE_FPS, hold=service.settings.hold, on_result=recorder.add if recorder else None,
                            connection=live.connection, locate=service.region_of(task),
                            answer_s=self._answer_s(engine))
        except BaseException:
            if recorder is not None:
                recorder.close()
            raise
        with self._lock:
            # Settings may have reloaded the model since engine() above: apply() closed every feed
            # it found, not this one, and the engine it was built on
            stale = service.current_engine() is not engine
            full = self._gate.full(self._feeds, (session, "pull"))  # others started meanwhile
            if not stale and not full:
                self._feeds[(session, "pull")] = feed
                if recorder is not None:
                    self._recorders[(session, "pull")] = recorder
                if feed.session is not None:  # an apply() meanwhile that needed no reload
                    feed.session.set_params(service.params())
                share_inflight(self._feeds)
        if stale or full:
            feed.close()
            if recorder is not None:
                recorder.close()
                recorder.path.unlink(missing_ok=True)
            raise UIError(full or "the engine was reloaded (Settings) while this Start opened its source: Start again")
        activity.feed_started(session, name or source, task, record)
        return feed

    def recording(self, session: str, kind: str = "pull") -> Path:
        """The MP4 of this session's recorded live feed ("pull") or camera ("push"). A recording
        still running ends here (the feed goes on unrecorded): the file is complete when it is
        handed over."""
        with self._lock:
            recorder = self._recorders.get((session, kind))
            feed = self._feeds.get((session, kind))
            if feed is not None and recorder is not None and feed.on_result == recorder.add:
                feed.on_result = None
        if recorder is None:
            raise UIError("nothing recorded: tick Record, then Start" if kind == "pull" else
                          "nothing recorded: tick Record while your camera streams")
        recorder.close()
        if recorder.error is not None:
            raise UIError(f"the recording failed: {recorder.error}")
        if not recorder.written:
            raise UIError("nothing recorded yet: no frame was captioned")
        return recorder.path

    def _drop_recording(self, session: str, kind: str) -> None:
        with self._lock:
            recorder = self._recorders.pop((session, kind), None)
        if recorder is not None:
            recorder.close()
            recorder.path.unlink(missing_ok=True)

    def feed(self, session: str, kind: str = "pull"):
        with self._lock:
            return self._feeds.get((session, kind))

    def stop_live(self, session: str, kind: str = "pull", why: str = "stopped") -> None:
        """why: what the activity log says ended it (the feed's own error is added)."""
        dropped = []
        with self._lock:
            feed = self._feeds.pop((session, kind), None)
            if feed is not None:
                self._ended[(session, kind)] = feed
                dropped = self._keep_stopped(session)
            share_inflight(self._feeds)
            recorder = self._recorders.get((session, kind))
        if feed is not None:
            feed.close()
            activity.feed_stopped(session, kind, feed, why)
        if recorder is not None:  # the file is finished, kept for a download
            recorder.close()
        _remove(dropped)

    def _keep_stopped(self, session: str) -> list:
        """With the lock held, as a session stops a feed: the recorders to delete once it is let go,
        those of the sessions past STOPPED_KEPT, whose stopped feeds go too (not a running one's)."""
        self._stopped[session] = None
        self._stopped.move_to_end(session)
        dropped = []
        while len(self._stopped) > STOPPED_KEPT:
            old = self._stopped.popitem(last=False)[0]
            for kind in ("pull", "push"):
                self._ended.pop((old, kind), None)
                if (old, kind) not in self._feeds:
                    dropped.append(self._recorders.pop((old, kind), None))
            if (old, "push") not in self._feeds:  # its camera's next Record starts a new file
                self._cam_record.pop(old, None)
        return dropped

    def push_frame(self, session: str, rgb: np.ndarray, task: dict, record: bool = False) -> object:
        """A browser camera frame; the session's pushed feed starts on the first one. Ticking
        `record` (or streaming with it ticked) starts a recording of the camera's captioned frames,
        replacing the last; unticking it finishes the file, kept for `recording(session, "push")`."""
        from engine.request import as_rgb
        from pipelines.feed import LiveFeed
        from pipelines.recorder import Recorder

        rgb = as_rgb(rgb)  # an ImageError for what is no picture (a grey float frame was a cv2 error)
        key, finished, service, dropped = (session, "push"), None, self._service, []
        with self._lock:
            self._check_open(session)
            feed = self._feeds.get(key)
            resumed = feed is not None and silent(feed)
            if feed is None or feed.task != task:  # a new prompt starts a new feed
                if feed is None or silent(feed):
                    self._check_room(key)
                first = feed is None
                engine = service.engine()
                new = LiveFeed(engine, task, service.params(), hold=service.settings.hold,
                               locate=service.region_of(task), answer_s=self._answer_s(engine))
                if feed is not None:
                    new.on_result = feed.on_result  # a recording goes on across the change
                    new.continue_records(feed)  # and so does the camera's Export
                    self._ended[key] = feed
                    dropped = self._keep_stopped(session)
                    feed.close()
                else:  # the camera goes on across a reload (stop_all): its Export and a ticked recording too
                    if key in self._ended:  # (its Export had held the new engine's answers alone)
                        new.continue_records(self._ended[key])
                    if self._cam_record.get(session) and key in self._recorders:
                        new.on_result = self._recorders[key].add
                feed = self._feeds[key] = new
                share_inflight(self._feeds)
                activity.camera_started(session, task, first)
            elif resumed:  # it takes its share back from this frame on
                self._check_room(key)
                feed.pushed_at = time.monotonic()
                share_inflight(self._feeds)
            was, self._cam_record[session] = self._cam_record.get(session, False), record
            if record and not was:
                self._drop_recording(session, "push")  # the last one (finished: unticked or downloaded)
                # closed when unticked or downloaded, perhaps long after the camera stopped: its
                # last frame lasts until its answer came, not until then (a frozen frame for minutes)
                recorder = self._recorders[key] = Recorder(service.jobs.recording_path("camera"),
                                                           max_seconds=RECORD_MAX_S, hold_to_close=False)
                feed.on_result = recorder.add
            elif was and not record:
                feed.on_result, finished = None, self._recorders.get(key)
        if finished is not None:
            finished.close()  # kept for a download
        _remove(dropped)
        feed.push(rgb, source_id="browser camera")
        return feed

    def _check_room(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._gate.check_room(self._feeds, key)

    def _check_open(self, session: str) -> None:
        """A session's page is gone once closed: a camera frame that arrives after its unload
        would start a feed that nobody closes (and that takes a share of every viewer's frames)."""
        self._gate.check_open(session)

    def camera_silent(self, session: str) -> None:
        """The session's camera stopped sending (the page's timer says so): its feed stays, for its
        Export and its next frame, but its share of the frames in flight goes to the other feeds
        (it had kept it until the tab closed: a viewer beside a stopped camera ran on half)."""
        with self._lock:
            share_inflight(self._feeds)

    def _answer_s(self, engine) -> float:
        with self._lock:
            return latest_answer_s(self._feeds, engine)

    def _feeds_to_export(self, session: str, kind: str) -> list:
        """The session's running feed of that kind, then the last one it stopped (either may be absent)."""
        with self._lock:
            return [f for f in (self._feeds.get((session, kind)), self._ended.get((session, kind))) if f]

    def export_log(self, session: str, kind: str = "pull") -> Path:
        """The captions of the session's live feed ("pull": a source, "push": its camera), or of
        the last one it stopped (`live_exports.export_log`)."""
        return live_exports.export_log(self._feeds_to_export(session, kind), kind, self._service.jobs)

    def export_shots(self, session: str, kind: str = "pull") -> Path:
        """The change pictures of the session's live feed, or of the last one it stopped
        (`live_exports.export_shots`)."""
        return live_exports.export_shots(self._feeds_to_export(session, kind), kind, self._service.jobs)

    def close_session(self, session: str) -> None:
        with self._lock:
            self._gate.close(session)
        self._service.jobs.cancel(session)
        with self._lock:
            # a Start still opening its source would install its feed after us: wait for it
            starting = self._starting.get(session) or contextlib.nullcontext()
        with starting:
            for kind in ("pull", "push"):
                self.stop_live(session, kind, "the tab closed")
                with self._lock:
                    self._ended.pop((session, kind), None)
        for kind in ("pull", "push"):
            self._drop_recording(session, kind)
        with self._lock:
            self._cam_record.pop(session, None)
            self._starting.pop(session, None)
            self._stopped.pop(session, None)


    # ---------------------------------------------------------------- the service's settings and end
    def set_params(self) -> None:
        """Every running feed takes the service's sampling parameters from its next frame, and its
        Changes' hold from its next answer."""
        with self._lock:
            for feed in self._feeds.values():
                feed.set_hold(self._service.settings.hold)
                if feed.session is not None:
                    feed.session.set_params(self._service.params())

    def stop_all(self, why: str = "the engine was reloaded") -> None:
        """Stop every feed (its engine is closing) and finish every recording. why: for the activity log."""
        dropped = []
        with self._lock:
            for key in list(self._feeds):  # each page says why it stopped, and keeps its captions to export
                feed = self._feeds.pop(key)
                feed.error = feed.error or "stopped: the engine was reloaded (Settings); Start again"
                feed.close()
                activity.feed_stopped(key[0], key[1], feed, why)
                self._ended[key] = feed  # its session let go of the engine when it closed
                dropped += self._keep_stopped(key[0])
            for (session, kind), recorder in self._recorders.items():  # finished files stay for their downloads
                # A camera's Record box still ticked: its next frame starts a feed on the new
                # engine, which records on into the same file (it had stopped there, box ticked).
                if kind != "push" or not self._cam_record.get(session):
                    recorder.close()
        _remove(dropped)

    def forget_recordings(self) -> None:
        """Finish every recording and forget it (the server is stopping: its files go with the outputs)."""
        with self._lock:
            for recorder in self._recorders.values():
                recorder.close()
            self._recorders.clear()


def _remove(recorders: list) -> None:
    """Finish these recordings (None: none) and delete their files: their downloads are dropped."""
    for recorder in filter(None, recorders):
        recorder.close()
        recorder.path.unlink(missing_ok=True)
