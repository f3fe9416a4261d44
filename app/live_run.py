"""One `vlmstream live` run of captions or answers (--detect/--point: app/live_locate.py), from
the model's warm-up to its closing figures: what it writes (the terminal lines, the -o log,
--snapshots, the --annotate recordings), the answers it follows (--changes), and the first write
that failed, which stops the run (exit 1; a closed pipe, as into `head`, exit 0 quietly). The
feeds' threads report through `show` under one lock; the main thread does the rest. A stream's or
a camera's outages are marked in the log (an "outage" line when one is found, ends, is given up,
or the run ends in it) and in its recording (`Recorder.outage`), from its sources' threads (`outage`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from engine.types import EngineStats
from pipelines.changes import AnswerChanges
from pipelines.outage import Outage
from pipelines.prompts import prompt_label
from pipelines.recorder import Recorder
from pipelines.sinks import json_text
from pipelines.sources import SourceError

from app.launcher import stop_requested
from app.live import p50_text, rate_text
from app.live_files import file_names, log_name
from app.live_report import closing_error, mark_outage, never_came, newly_failed, run_rate

# With several sources, the JSON's totals (each source's own figures, percentiles included, are
# under "sources"; achieved_fps is the run's, run_rate: the rates' sum when every source ran to the end).
_SUMMED = ("frames_in", "submitted", "completed", "cancelled_stale", "cancelled_deadline", "cancelled_closed",
           "dropped", "achieved_fps")
# Frames each source read but never offered (its feed's grabber counts them): summed too, so that
# the totals add up to the frames read. Left out, `live a b --fps 10 --json` said 62 frames in of
# the 247 the two clips sent, with nothing at the top saying where the other 185 went.
_GRABBED = ("overwritten_at_grab", "above_fps")


class LiveRun:
    """A run's outputs and the state they share; `labels` name its sources, `log` is the -o log
    (None, standard output or an open file: app.live_files.open_log)."""

    def __init__(self, args: argparse.Namespace, labels: list[str], log, snapshots: Path | None,
                 model: str, in_order: frozenset[int] = frozenset()) -> None:
        self.args, self.labels, self.log, self.snapshots, self.model = args, labels, log, snapshots, model
        self.in_order = in_order  # the constrained prompts' indices: --changes keeps their answers' order
        self.several = len(labels) > 1
        self.width = max(map(len, labels))  # the terminal's lines keep their columns whatever source they name
        self.write_error: list[tuple[str, OSError]] = []  # (what, error): the run stops
        self.print_lock = threading.Lock()
        # --changes: each source's answers are followed, and only the new ones reported
        self.names = dict(zip(labels, file_names(args.sources, labels, getattr(args, "source_names", None))))  # snapshots
        self.changes = {label: AnswerChanges(args.hold or 1) for label in labels} if args.changes else None
        self.recorders: dict = {}  # label -> Recorder, with --annotate (started once the model is up)
        self.failed_said: set[str] = set()  # sources whose failure was said while the others went on

    def say(self, line: str) -> None:
        with self.print_lock:
            print(f"vlmstream: warning: {line}", file=sys.stderr, flush=True)

    def start(self, opened: list, recordings: list[Path] | None) -> None:
        """Once the model is up: the recordings begin, and each stream's outages are said."""
        self.recorders.update((label, Recorder(path)) for label, path in zip(self.labels, recordings or []))
        for live, label in zip(opened, self.labels):
            if live.connection is not None:  # an outage is said when it happens, not only in the closing figures
                live.connection.on_event = lambda line, label=label: self.say(
                    f"{label + ': ' if self.several else ''}{line}")
                live.connection.on_outage = lambda outage, label=label: self.outage(label, outage)

    def outage(self, label: str, outage: Outage, state: str | None = None) -> None:
        mark_outage(self, self.print_lock, label, outage, state)

    def say_failed(self, feeds: list) -> None:
        """Each source that failed while others go on, said then, once (`newly_failed`)."""
        errors = {label: feed.error for feed, label in zip(feeds, self.labels) if feed.error is not None}
        for _, line in newly_failed(errors, {lb for f, lb in zip(feeds, self.labels) if f.running},
                                         self.failed_said):
            self.say(line)

    def ended_early(self, feeds: list) -> None:
        """The recording of each source that ended on its own (a file played once, a camera given
        up) ends with its last answer, not with the run: a 2 s clip beside a 6 s one was recorded
        6 s long, its last frame frozen for the rest (a camera gone for good: for hours)."""
        for feed, label in zip(feeds, self.labels):
            if not feed.running and label in self.recorders:
                self.recorders[label].hold_to_close = False  # frames still in flight lengthen it

    @property
    def stopped(self) -> bool:
        """A write failed (the log, a snapshot, standard output, a recording): the run stops."""
        return bool(self.write_error) or any(rec.error for rec in self.recorders.values())

    def show(self, label: str, r) -> None:
        """A completed frame (the feeds' threads): recorded, logged, printed; with --changes only
        the answers that changed (--snapshots: each with the frame it began on)."""
        args, log, snapshots, write_error = self.args, self.log, self.snapshots, self.write_error
        if label in self.recorders:
            self.recorders[label].add(r)  # every completed frame, whether its answers changed or not
        with self.print_lock:  # several feeds' threads report here
            new, shots = None, []  # with --changes: the answers that changed, the snapshot of each
            if self.changes is None:
                lines = r.text.splitlines() or [""]  # one line per prompt
            else:
                new = self.changes[label].update(r, self.in_order)
                if not new:
                    return
                if snapshots is not None and not write_error:
                    from app.live_files import save_change_frame  # looked up here: a test stands a full disk in for it

                    try:  # the frame each answer began on (--hold N: N-1 frames back), once a frame
                        saved: dict = {}
                        for c in new:
                            first = c.since_kept or r.frame
                            if first.index not in saved:
                                saved[first.index] = str(save_change_frame(snapshots, self.names[label] if self.several
                                                                   else "", first))
                            shots.append(saved[first.index])
                    except OSError as e:  # a run that cannot keep its pictures stops and says so (the
                        write_error.append((f"a snapshot in {snapshots}", e))  # change is still logged)
                lines = [(f"{prompt_label(r.prompts[c.prompt])}: " if len(r.prompts) > 1 else "") + c.text
                         + ("" if c.previous is None else f"  (was: {c.previous})") for c in new]
            if log is not None and not any(what == args.output for what, _ in write_error):
                records = r.records() if new is None else AnswerChanges.records(r, new)
                for x in records:
                    x["model"] = self.model  # as in video's lines: a log restarted with another model tells them apart
                if snapshots is not None:
                    for i, x in enumerate(records):
                        x["snapshot"] = shots[i] if i < len(shots) else None
                try:
                    log.write("".join(json_text(x) + "\n" for x in records))
                    log.flush()
                except OSError as e:  # disk full, a closed pipe: the run stops and says so
                    write_error.append((log_name(args.output), e))
            if not args.json and log is not sys.stdout and not write_error:
                prefix = f"{label:<{self.width}}  " if self.several else ""
                try:
                    for line in lines:
                        print(f"{prefix}{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  {line}", flush=True)
                except OSError as e:  # `head` closed the pipe, or the disk under a redirect is full: stop
                    write_error.append(("standard output", e))

    def close_feeds(self, feeds: list, cancel: bool) -> bool:
        """Stop the feeds, then their frames in flight finish, reported and recorded (with cancel,
        a Ctrl-C, they are cancelled); the run's figures and recordings are taken after. A slow
        model's frames take a while: said after 2 s, and a Ctrl-C meanwhile cancels them. The
        wait had ended after 30 s (Moondream 2 on a CPU: 25-70 s a frame) with a false warning,
        a summary short of the frames still to come, and recordings closed before them. True if
        a Ctrl-C came meanwhile."""
        from app.live import WAIT_NOTICE_S  # looked up at each run: a test says it at once

        waiting = sum(f.session.in_flight for f in feeds)

        def notice() -> None:
            with self.print_lock:
                print(f"vlmstream: waiting for the {waiting} frame{'s' * (waiting != 1)} in flight "
                      f"(Ctrl-C cancels {'them' if waiting != 1 else 'it'})", file=sys.stderr, flush=True)

        timer = threading.Timer(WAIT_NOTICE_S, notice)
        timer.daemon = True
        if waiting and not cancel:
            timer.start()
        try:
            if cancel:
                self._cancelling(waiting)
                for feed in feeds:
                    feed.close(cancel=True, timeout=30.0)
            else:
                _wait_closed(feeds)
            return False
        except KeyboardInterrupt:
            timer.cancel()  # not said after the line below
            self._cancelling(sum(f.session.in_flight for f in feeds))
            for feed in feeds:
                feed.close(cancel=True, timeout=30.0)
            return True
        finally:
            timer.cancel()

    def _cancelling(self, n: int) -> None:
        """Said at once on Ctrl-C: the step under way ends before the run does (Moondream 2 on a
        CPU: ~7 s of silence after the Ctrl-C, and a user presses it again, or kills the run)."""
        if n:
            with self.print_lock:
                print(f"vlmstream: interrupted: cancelling the {n} frame{'s' * (n != 1)} in flight "
                      "(the model's step under way ends first)", file=sys.stderr, flush=True)

    def sources_ended(self, feeds: list, opened: list, interrupted: bool) -> list[dict]:
        """Once the feeds are closed: each source's figures, what went wrong with it said, and its
        recording closed (in the figures). A run in which no source could be read is its error."""
        labels, several = self.labels, self.several
        never_read = [f for f in feeds if isinstance(f.exception, SourceError) and not f.session.frames_in]
        if never_read and len(never_read) == len(feeds) and not interrupted:  # Ctrl-C: the summary, 130
            raise closing_error([f.exception for f in never_read])  # nothing was ever read: a plain error
        some_came = any(f.session.frames_in for f in feeds)
        for feed, label, live in zip(feeds, labels, opened):
            # a stream that broke off, or never came beside others that did
            problem = feed.error or never_came(live, feed.session.frames_in, some_came)
            if problem and label not in self.failed_said:
                print(f"vlmstream: warning: {label + ': ' if several else ''}{problem}", file=sys.stderr)
            for problem in live.problems:  # a file's, which names it
                print(f"vlmstream: warning: {problem}", file=sys.stderr)
        for live, label in zip(opened, labels):  # its "began" line had no end: the log says why
            if live.connection is not None and live.connection.outage is not None:
                self.outage(label, live.connection.outage, "unfinished")
        per_source = [f.snapshot().counters for f in feeds]
        for live, s, label in zip(opened, per_source, labels):
            st = live.stream  # how the network (or the pipe) held up: s["stream"], from the feed
            if st is not None and st.catch_ups:
                print(f"vlmstream: warning: {label + ': ' if several else ''}decoding fell behind the stream "
                      f"({st.max_late:.1f} s at most) and skipped ahead to its newest keyframe {st.catch_ups} "
                      "times: a lower resolution or frame rate (a camera's substream) would keep up",
                      file=sys.stderr)
        for label, s in zip(labels, per_source):
            if label in self.recorders:  # after the feeds: their last frames are in
                rec = self.recorders[label]
                rec.close()
                # no path where nothing was recorded: no file was made (a stream that sent no keyframe)
                s["recording"] = {"path": str(rec.path) if rec.path.exists() else None, "frames": rec.written,
                                  "skipped": rec.skipped}
                if rec.error is not None and not self.write_error:
                    self.write_error.append((str(rec.path), rec.error))
        return per_source

    def close_log(self) -> int | None:
        """The log closed; then, where a write failed, the run's exit code (said), else None."""
        log, write_error = self.log, self.write_error
        if log is not None and log is not sys.stdout:
            try:
                log.close()
            except OSError as e:  # its last flush: said already if a write had failed
                if not write_error:
                    write_error.append((log_name(self.args.output), e))
        if write_error:
            if isinstance(write_error[0][1], BrokenPipeError):  # e.g. piped into `head`: stop quietly
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
                return 0
            what, e = write_error[0]
            print(f"vlmstream: error: cannot write {what}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
            return 1
        return None

    def report(self, per_source: list[dict], es: EngineStats, sticky: float) -> None:
        """The closing figures: one JSON object (--json), or a line per source on standard error."""
        args, labels, several, changes = self.args, self.labels, self.several, self.changes
        stats = per_source[0] if not several else {
            **{k: sum(s[k] for s in per_source) for k in _SUMMED if k != "achieved_fps"},
            **{k: sum(s.get(k, 0) for s in per_source) for k in _GRABBED if any(k in s for s in per_source)},
            "achieved_fps": run_rate(per_source),
            "sources": dict(zip(labels, per_source))}
        if changes is not None:  # answers reported as changed, per source
            for s, label in zip(per_source, labels):
                s["changes"] = changes[label].count
            stats["changes"] = sum(c.count for c in changes.values())
        stats["kv_pages_in_use_after"] = es.kv_pages_in_use
        stats["draft_tokens"] = {"proposed": es.draft_proposed, "accepted": es.draft_accepted}
        stats["sticky"] = sticky
        if args.json:
            print(json.dumps(stats))
        else:
            for label, s in zip(labels, per_source):
                print(f"vlmstream: {label + ': ' if several else ''}{s['completed']} of {s['frames_in']} frames captioned, "
                      f"{rate_text(s['achieved_fps'])}, {s['cancelled_stale']} stale cancelled, "
                      + (f"{s['cancelled_deadline']} past the deadline, " if args.deadline_ms else "")
                      # the frames a Ctrl-C cancelled in flight: without them the figures fell
                      # short of the frames in ("1 of 2121 captioned, 2119 dropped")
                      + (f"{s['cancelled_closed']} cancelled at the stop, " if s.get("cancelled_closed") else "")
                      + f"{s['dropped']} dropped" + p50_text(s), file=sys.stderr)


def _wait_closed(feeds: list) -> None:
    """Close the feeds letting their frames in flight finish, as long as they take, on a thread of
    its own: the main thread polls for a SIGTERM whose KeyboardInterrupt was lost (raised inside a
    finalizer, which Python ignores) and raises it, which cancels those frames, where a wait
    without end would have left the run going after its `kill`."""
    failed: list[BaseException] = []
    stop = threading.Event()  # the main thread cancels: the feeds left are its to close

    def close_all() -> None:
        try:
            for feed in feeds:
                if stop.is_set():
                    return
                feed.close(cancel=False, timeout=None)
        except BaseException as e:  # reaches the caller
            failed.append(e)

    closer = threading.Thread(target=close_all, name="vlmstream-close", daemon=True)
    closer.start()
    try:
        while closer.is_alive():
            closer.join(0.05)
            if stop_requested():
                raise KeyboardInterrupt
    except BaseException:
        stop.set()
        raise
    if failed:
        raise failed[0]
