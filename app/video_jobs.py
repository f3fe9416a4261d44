"""The web UI's video jobs, apart from what they caption: their turns, their stop flags, their folders.

At most VIDEO_SLOTS jobs run at once; the others wait for a turn, each reachable by its session's
Cancel meanwhile. Every output the server hands over (a job's captions and MP4, a live recording,
an export) is written under one scratch folder of this process, removed when the server stops;
a job's folder stays until VIDEO_JOBS_KEPT newer ones exist, but never goes while its job writes.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from app.errors import UIError

# A video job's outputs stay on disk until this many newer jobs have run (Gradio serves its own
# copies of them; ours only need to outlive the hand-over), and go when the server stops.
VIDEO_JOBS_KEPT = 8
VIDEO_SLOTS = 2  # video jobs run at once; the others wait, each its Cancel working meanwhile
# Downloads (exports, recordings) handed to the web page that stay served, the oldest removed
# first. Gradio kept a copy of each for a day: a client that asked for a live export in a loop
# (each new, its feed captioning meanwhile) filled the server's disk at ~300 KB a call.
HANDED_KEPT = 32


class VideoJobs:
    def __init__(self, slots: int = VIDEO_SLOTS):
        self._lock = threading.RLock()
        self._slots = threading.Semaphore(slots)
        # session -> the stop flags of its running video jobs (a tab, or an API client, may run several)
        self._stops: dict[str, set[threading.Event]] = {}
        self._scratch: Path | None = None
        self._folders: deque[Path] = deque()
        self._writing: set[Path] = set()  # job folders a running video job still writes to
        self._handed: deque[Path] = deque()  # the downloads handed over, oldest first (`hand_over`)

    # ---------------------------------------------------------------- stop flags and turns
    def stop_flag(self, session: str) -> threading.Event:
        """A new video job's stop flag for a session. Cancel, or the tab closing, sets the flags of
        all the session's running jobs: a job started while another runs must not escape them."""
        stop = threading.Event()
        with self._lock:
            self._stops.setdefault(session, set()).add(stop)
        return stop

    def forget(self, stop: threading.Event | None) -> None:
        """A job's stop flag, once the job is over (or never started)."""
        with self._lock:
            for session, stops in list(self._stops.items()):
                stops.discard(stop)
                if not stops:
                    del self._stops[session]

    def cancel(self, session: str) -> int:
        """Stop every running video job of a session; returns how many there were."""
        with self._lock:
            stops = self._stops.pop(session, set())
        for stop in stops:
            stop.set()
        return len(stops)

    def wait_turn(self, stop: threading.Event, waiting: Callable[[], None]) -> bool:
        """Wait for one of the slots (`waiting` is called now and then meanwhile); False if the
        job's `stop` is set first (Cancel, the tab closed), True once it may run: `end_turn` then.
        Gradio's own limit had kept a waiting job out of reach of Cancel (its stop flag came when
        it started), and it ran to its end."""
        while not self._slots.acquire(timeout=0.25):
            if stop.is_set():
                return False
            waiting()
        if stop.is_set():
            self._slots.release()
            return False
        return True

    def end_turn(self) -> None:
        self._slots.release()

    # ---------------------------------------------------------------- folders
    def scratch(self) -> Path:
        """This process's folder of outputs (video jobs, recordings, exports), made on first use."""
        with self._lock:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="vlmstream-ui-"))
            return self._scratch

    def recording_path(self, kind: str) -> Path:
        """A new recording's file, named at random: named after the session, its download told
        the session's id, which Gradio's unauthenticated heartbeat route takes (a closed
        connection on it closed the session: its feeds stopped, its recording deleted)."""
        return self.scratch() / f"{kind}-{secrets.token_hex(6)}.mp4"

    def new_folder(self) -> Path:
        """A new folder for one video job's outputs (or an export); the oldest beyond
        VIDEO_JOBS_KEPT are deleted, but never one that a running video job writes to: other
        viewers' exports would otherwise pull a long job's folder from under it."""
        with self._lock:  # held from the scratch folder on: a remove() meanwhile would take it away
            job = Path(tempfile.mkdtemp(prefix="video-", dir=self.scratch()))
            self._folders.append(job)
            idle = [j for j in self._folders if j not in self._writing]
            for old in idle[: max(0, len(self._folders) - VIDEO_JOBS_KEPT)]:
                self._folders.remove(old)
                shutil.rmtree(old, ignore_errors=True)
            return job

    def hand_over(self, path: Path, served: str | Path) -> Path:
        """A copy of the download `path` in the folder `served` (Gradio's: a file there is served
        as it is, not copied again for a day); the HANDED_KEPT newest copies stay, older ones go."""
        copy = Path(served) / f"download-{secrets.token_hex(16)}" / path.name
        try:
            copy.parent.mkdir(parents=True)
            shutil.copyfile(path, copy)
        except OSError as e:
            shutil.rmtree(copy.parent, ignore_errors=True)
            raise UIError(f"cannot write {path.name} on the server: {e.strerror or e}") from None
        with self._lock:
            self._handed.append(copy)
            while len(self._handed) > HANDED_KEPT:
                shutil.rmtree(self._handed.popleft().parent, ignore_errors=True)
        return copy

    @contextmanager
    def writing(self, folder: Path) -> Iterator[None]:
        """While a job writes into `folder`: no newer job's folder pushes it out."""
        with self._lock:
            self._writing.add(folder)
        try:
            yield
        finally:
            with self._lock:
                self._writing.discard(folder)

    def remove(self) -> None:
        """Delete every output (the server is stopping); a later job makes a new scratch folder."""
        with self._lock:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            self._folders.clear()
