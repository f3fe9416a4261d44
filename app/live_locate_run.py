"""One `vlmstream live --detect/--point` run (app/live_locate.py), from the warm-up to its closing
figures: what it writes (a terminal line per located frame, the -o log, --snapshots, the
--annotate recordings), the numbers found it follows (--changes), and the first write that failed,
which stops the run (exit 1; a closed pipe, as into `head`, exit 0 quietly). The locator's thread
reports through `show` under one lock; the main thread does the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from pipelines.changes import AnswerChanges
from pipelines.locator import LiveLocator, count_change, places_text
from pipelines.recorder import Recorder
from pipelines.sinks import json_text
from pipelines.sources import SourceError

from app.console import StandardOutputError
from app.live import p50_text, rate_text
from app.live_files import file_names, log_name
from app.live_report import closing_error, mark_outage, never_came, newly_failed, run_rate


class LiveLocateRun:
    """A run's outputs and the state they share; `labels` name its sources, `log` is the -o log
    (None, standard output or an open file: app.live_files.open_log), `task` "detect" or "point" and
    `what` the object. The recordings begin when it is made."""

    def __init__(self, args: argparse.Namespace, labels: list[str], log, recordings: list[Path] | None,
                 task: str, what: str, model: str) -> None:
        self.args, self.labels, self.log, self.task, self.what, self.model = args, labels, log, task, what, model
        self.several = len(labels) > 1
        self.width = max(map(len, labels))  # the terminal's lines keep their columns whatever source they name
        self.lock = threading.Lock()
        self.write_error: list[tuple[str, OSError]] = []  # (what, error): the run stops
        self.recorders = {label: Recorder(path) for label, path in zip(labels, recordings or [])}
        # --changes: each source's number found is followed, and only a new one reported
        self.changes = {label: AnswerChanges(args.hold or 1) for label in labels} if args.changes else None
        self.snapshots = Path(args.snapshots) if args.snapshots else None
        # the snapshots' names for the sources, as their recordings': "Front door" and "Front_door"
        # had both saved as Front_door_7.jpg where their recordings were Front_door_1 and _2
        self.names = dict(zip(labels, file_names(args.sources, labels, getattr(args, "source_names", None))))
        self.failed_said: set[str] = set()  # sources whose failure was said while the others went on
        self.opened: list = []  # the sources, once started

    def say(self, line: str) -> None:
        with self.lock:
            print(f"vlmstream: warning: {line}", file=sys.stderr, flush=True)

    def say_failed(self, locator: LiveLocator) -> None:
        """Each source that failed while others go on, said then, once (`newly_failed`)."""
        for _, line in newly_failed(locator.errors(), locator.going(), self.failed_said):
            self.say(line)

    def start(self, opened: list) -> None:
        """Once the model is warm: each stream's outages are said as they happen, and marked in
        its log and recording (as live's: `mark_outage`)."""
        self.opened = opened
        for live, label in zip(opened, self.labels):
            if live.connection is not None:
                live.connection.on_event = lambda line, label=label: self.say(
                    f"{label + ': ' if self.several else ''}{line}")
                live.connection.on_outage = lambda outage, label=label: mark_outage(self, self.lock, label, outage)

    @property
    def stopped(self) -> bool:
        """A write failed (the log, a snapshot, standard output, a recording): the run stops."""
        return bool(self.write_error) or any(rec.error for rec in self.recorders.values())

    def show(self, r) -> None:  # the locator's thread, once per located frame
        """A located frame: recorded, logged, printed; with --changes only when the number found
        differs from the source's last report (--snapshots: with the frame the new number began on)."""
        args, log, snapshots, changes, write_error = self.args, self.log, self.snapshots, self.changes, self.write_error
        if r.label in self.recorders:
            self.recorders[r.label].add(r.drawn())
        with self.lock:
            if write_error:
                return
            change = None if changes is None else count_change(changes[r.label], r.label, len(r.places), r.frame.pts, r)
            if changes is not None and change is None:
                return  # as many found as at the last report
            first = (change.pop("kept") if change else None) or r  # where the new count began (--hold N: N-1 back)
            try:
                if snapshots is not None:
                    from app.live_files import save_change_frame  # looked up when used: a test stands a full disk in for it

                    try:
                        change["snapshot"] = str(save_change_frame(snapshots, self.names[r.label] if self.several else "",
                                                           first.drawn().frame))
                    except OSError as e:
                        write_error.append((f"a snapshot in {snapshots}", e))
                        return
                if log is not None:
                    log.write(json_text({**r.records()[0], **(change or {}), "model": self.model}) + "\n")
                    log.flush()
                if not args.json and log is not sys.stdout:
                    was = "" if not change or change["previous"] is None else f"  (was {change['previous']} found)"
                    prefix = f"{r.label:<{self.width}}  " if self.several else ""
                    print(f"{prefix}{r.frame.pts:9.3f}  {r.end_to_end_ms:6.1f} ms  "
                          f"{self.what}: {places_text(r.pixels, self.task)}{was}", flush=True)
            except OSError as e:  # a full disk, a closed pipe: the run stops and says so
                on_stdout = isinstance(e, (BrokenPipeError, StandardOutputError))
                write_error.append(("standard output" if on_stdout else log_name(args.output), e))

    def close(self, locator: LiveLocator) -> bool:
        """The run's end, however it came: the locator, the recordings and the log closed. True
        if it gave up: a source failed for good."""
        # the run ended because its sources did (before --duration): on an error, it failed
        # As live's: a source that had sent frames and failed for good fails the run, others or not
        failed = [label for label, e in locator.exceptions().items() if isinstance(e, SourceError)]
        read = {label: st["frames_in"] for label, st in locator.stats().items()}
        gave_up = bool(failed) and (not locator.running or any(read.get(label) for label in failed))
        # As live's (LiveRun.ended_early), before the close ends the others: the recording of a
        # source that ended on its own ends with its last frame located, not with the run (a 1 s
        # clip beside a 2 s one had been recorded 2 s long, its last frame frozen for the rest).
        going = locator.going()
        for label, rec in self.recorders.items():
            if label not in going:
                rec.hold_to_close = False
        locator.close()
        for live, label in zip(self.opened, self.labels):  # its "began" line had no end: the log says why
            if live.connection is not None and live.connection.outage is not None:
                mark_outage(self, self.lock, label, live.connection.outage, "unfinished")
        for rec in self.recorders.values():
            rec.close()
        if self.log is not None and self.log is not sys.stdout:
            try:
                self.log.close()
            except OSError as e:  # its last flush: said already if a write had failed
                if not self.write_error:
                    self.write_error.append((log_name(self.args.output), e))
        return gave_up

    def sources_ended(self, locator: LiveLocator, opened: list) -> dict[str, dict]:
        """Once closed: each source's figures (its recording's among them), what went wrong with
        it said. The decoder's error, or a run in which no source could be read, is its error."""
        locator.check()  # the decoder failed: its error, as any other
        stats = locator.stats()
        failed = locator.exceptions()
        if failed and len(failed) == len(self.labels) and not any(s["frames_in"] for s in stats.values()):
            raise closing_error(list(failed.values()))  # nothing was ever read: a plain error
        errors, some_came = locator.errors(), any(s["frames_in"] for s in stats.values())
        for label, live in zip(self.labels, opened):
            # as live's: a source that never came beside others that did is said (it had passed without a word)
            error = errors.get(label) or never_came(live, stats[label]["frames_in"], some_came)
            if error and label not in self.failed_said:
                print(f"vlmstream: warning: {label + ': ' if self.several else ''}{error}", file=sys.stderr)
        for problem in (p for live in opened for p in live.problems):  # a file's, which names it
            print(f"vlmstream: warning: {problem}", file=sys.stderr)
        for label, rec in self.recorders.items():
            stats[label]["recording"] = {"path": str(rec.path), "frames": rec.written, "skipped": rec.skipped}
            if rec.error is not None and not self.write_error:
                self.write_error.append((str(rec.path), rec.error))
        return stats

    def write_failed(self) -> int | None:
        """Where a write failed, the run's exit code (said), else None."""
        if not self.write_error:
            return None
        what_failed, e = self.write_error[0]
        if isinstance(e, BrokenPipeError):  # piped into `head`: stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(f"vlmstream: error: cannot write {what_failed}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1

    def report(self, stats: dict[str, dict]) -> None:
        """The closing figures: one JSON object (--json), or a line per source on standard error."""
        args, several, changes = self.args, self.several, self.changes
        summary = stats[self.labels[0]] if not several else {
            "frames_in": sum(s["frames_in"] for s in stats.values()),
            "completed": sum(s["completed"] for s in stats.values()),
            "achieved_fps": run_rate(list(stats.values())), "sources": stats}
        if changes is not None:  # reports of a new number found, per source
            for label, s in stats.items():
                s["changes"] = changes[label].count
            if several:
                summary["changes"] = sum(c.count for c in changes.values())
        summary.update({self.task: self.what, "model": args.model})
        if args.json:
            print(json.dumps(summary))
        else:
            for label, s in stats.items():
                print(f"vlmstream: {label + ': ' if several else ''}{s['completed']} of {s['frames_in']} frames "
                      f"located, {rate_text(s['achieved_fps'])}, {s['overwritten']} passed over" + p50_text(s)
                      + (f", {s['changes']} changes" if "changes" in s else ""), file=sys.stderr)
