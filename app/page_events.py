"""What a browser page's events do in the web UI (`app.ui` wires them to its components).

`PageEvents` holds one `Service` (shared by every tab) and the little each tab's page adds: which
feed its opening autoplayed, and whether it is away from Live. Handlers take Gradio's values and
return its updates; a user's mistake is raised as a one-line `gr.Error` (`user_error`). A live
feed's page is sent updates at most PAGE_HZ a second, and a page that reads none of them stops its
feed after ORPHAN_S. How a page's values are read and its errors said: app/page_values.py; what
the Settings tab does: app/settings_events.py (`PageEvents.settings`).
"""

import time
from pathlib import Path

import gradio as gr

from app import activity
from app.errors import UIError
from app.inflight_share import CAMERA_SILENT_S
from app.page_values import markdown_text, new_shots, number, unread, upload_named, user_error
from app.samples import sample_videos
from app.service import Service
from app.settings_events import SettingsEvents
from app.task import make_task
from app.video_jobs import VIDEO_SLOTS
from app.view import chart_svg, counters_html, frame_html, log_text, shots_html
from engine import VlmstreamError
from engine.request import as_rgb
from pipelines.locator import places_text

PAGE_HZ = 12.0  # frame + caption updates per second pushed to a watching page (at most)
SLOW_HZ = 2.0  # chart, counters and log
MIN_GAP_S = 0.02
# Updates Gradio holds for a page, unread: past BACKLOG_MAX the page's updates wait (a slow link
# gets fresh frames, not a growing delay); unread for ORPHAN_S, the feed stops. A feed started
# through the API by a client that never read its stream ran until the server stopped, its
# updates piling up in memory (3,000 in minutes), the engine busy for nobody.
BACKLOG_MAX = int(2 * PAGE_HZ)
ORPHAN_S = 60.0
VIDEO_TABLE_ROWS = 5000  # a page holds this many; the downloads hold every answer


class PageEvents:
    def __init__(self, service: Service, settings_by: frozenset[str] | None = None):
        """settings_by: the users who may apply Settings (`ui --settings-by`); None: every user."""
        self.service = service
        self.settings = SettingsEvents(service, settings_by)  # the Settings tab's
        self.demo = None  # the Blocks, once built: its queue tells how far behind a page reads
        # The sample a page plays on opening stops while the page is on another tab that works
        # (Browser webcam, Video file, Image), or hidden in the browser, and starts over back on
        # Live: it took 3/4 of the engine from those tabs (a video job beside it took 4x as long),
        # and a page left open in the background kept the cores busy for nobody. A feed the user
        # started keeps running (a camera watched for its changes, a recording).
        self.autoplayed: dict[str, object] = {}  # session -> its feed that the page's opening started
        self.paused: set[str] = set()  # sessions whose autoplayed feed waits for the Live tab
        self.away: set[str] = set()  # sessions whose page said last that it left Live (page_hidden)

    def live(self, src, upload, kind, question, ckind, ctext, record=False, request: gr.Request = None, auto=False):
        sid = request.session_hash
        activity.seen(sid, getattr(request, "username", None))
        try:
            task = make_task(kind, question, ckind, ctext, regions=True)
            # an upload's Export names it as uploaded, not by Gradio's scratch path (as a video job's JSONL)
            # "Record from Start": the sample a page plays by itself (on opening, back on Live)
            # is not recorded with the box ticked and no Start pressed.
            # a listed source by its name: its URL (and password) never in what the page sees
            source, name = (upload, Path(upload).name) if upload else self.service.sources.resolve(src, sample_videos())
            feed = self.service.start_live(sid, source, task, record=bool(record) and not auto, name=name)
            if auto:
                self.autoplayed[sid] = feed
            else:
                self.autoplayed.pop(sid, None)
            self.paused.discard(sid)
            if auto and sid in self.away:  # the page left Live while this opened: leave_live found nothing to pause
                self.paused.add(sid)
                self.service.stop_live(sid, why="the page left Live")
        except (UIError, VlmstreamError, OSError) as e:
            # A bad form (an empty question) fails before start_live: the feed that plays (the
            # sample) is stopped too, else its frames covered the message within a page update.
            self.service.stop_live(sid, why=f"a Start failed: {e}")
            self.autoplayed.pop(sid, None)
            e = upload_named(e, upload)
            # Again for two seconds: the previous feed's loop may have passed its check that it
            # still owns the page just before it was stopped, and its last frame must not land on
            # the message (once it did, in a browser test on a loaded machine, after 0.25 s).
            for _ in range(8):
                yield frame_html(None, f"error: {e}"), counters_html({}, self.service.engine_stats(), False, str(e)), \
                    gr.skip(), gr.skip(), gr.skip()
                time.sleep(0.25)
            return
        version, next_at, slow_at, shown = -1, time.monotonic(), 0.0, None
        why = "the page went away"  # what the activity log says ended the feed, if this ends it
        stuck = None  # (updates unread, since when) while the page reads none of them
        try:
            while True:
                if self.service.feed(sid) is not feed:  # replaced by a new Start: that one owns the page now
                    if self.service.feed(sid) is None:  # stopped: make sure the page says so (and why)
                        snap = feed.snapshot()
                        # before its first frame, the frame's place had said "connecting (0 s)" for ever
                        shown = gr.skip() if snap.frame_rgb is not None else frame_html(None, snap.error or "stopped")
                        yield shown, counters_html(snap.counters, self.service.engine_stats(), False, snap.error), \
                            gr.skip(), gr.skip(), gr.skip()
                    return
                now = time.monotonic()
                backlog = unread(self.demo, sid)
                if backlog is not None and backlog >= BACKLOG_MAX:
                    if stuck is None or backlog < stuck[0]:  # read from since: not stuck
                        stuck = (backlog, now)
                    elif now - stuck[1] > ORPHAN_S:
                        why = f"the page read no update for {ORPHAN_S:.0f} s"
                        return  # and the feed stops (below)
                    time.sleep(1.0 / PAGE_HZ)
                    next_at = time.monotonic()
                    continue
                stuck = None
                full = now >= slow_at or not feed.running
                snap = feed.snapshot(full=full)
                # before the first frame, each full update says how reaching the source goes
                frame = frame_html(snap) if snap.version != version or full and snap.frame_rgb is None else gr.skip()
                version = snap.version
                if full:
                    slow_at = now + 1.0 / SLOW_HZ
                    shots, shown = new_shots(snap.shots, shown)
                    yield (frame, counters_html(snap.counters, self.service.engine_stats(), snap.running, snap.error),
                           chart_svg(snap.latency, feed.window_s), log_text(snap.log),
                           gr.skip() if shots is None else shots_html(shots))
                else:
                    yield frame, gr.skip(), gr.skip(), gr.skip(), gr.skip()
                if not snap.running:
                    why = "it ended"
                    return
                next_at += 1.0 / PAGE_HZ  # a steady rate, not work + sleep; never a busy catch-up
                now = time.monotonic()
                next_at = max(next_at, now + MIN_GAP_S)
                time.sleep(next_at - now)
        finally:  # the page went away (or Stop): nothing keeps running for nobody
            if self.service.feed(sid) is feed:
                self.service.stop_live(sid, why=why)

    # Gradio passes the request to a parameter annotated gr.Request, not to one after *args
    def autoplay(self, src, upload, kind, question, ckind, ctext, record=False, request: gr.Request = None):
        yield from self.live(src, upload, kind, question, ckind, ctext, record, request, auto=True)

    def leave_live(self, request: gr.Request):
        sid = request.session_hash
        self.away.add(sid)
        feed = self.service.feed(sid)
        if feed is not None and self.autoplayed.get(sid) is feed:
            self.paused.add(sid)
            self.service.stop_live(sid, why="the page left Live")

    def back_to_live(self, src, upload, kind, question, ckind, ctext, record=False, request: gr.Request = None):
        self.away.discard(request.session_hash)
        if request.session_hash in self.paused and self.service.feed(request.session_hash) is None:
            yield from self.live(src, upload, kind, question, ckind, ctext, record, request, auto=True)
        else:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()

    def stop(self, request: gr.Request):
        activity.seen(request.session_hash, getattr(request, "username", None))
        feed = self.service.feed(request.session_hash)
        self.service.stop_live(request.session_hash, why="Stop")
        if feed is None:
            return gr.skip()
        snap = feed.snapshot()
        return counters_html(snap.counters, self.service.engine_stats(), False, snap.error)

    def download(self, make_file, kind: str):
        """A button's handler: the file `make_file(session, kind)` writes (captions, a recording)."""
        def run(request: gr.Request):
            try:
                path = make_file(request.session_hash, kind)
                # in Gradio's own folder, among a bounded number: its copy of each stayed a day
                return str(path if self.demo is None else self.service.jobs.hand_over(path, self.demo.GRADIO_CACHE))
            except UIError as e:
                raise user_error(str(e)) from None
        return run

    def webcam(self, rgb, kind, question, ckind, ctext, record, shown, request: gr.Request):
        activity.seen(request.session_hash, getattr(request, "username", None))
        if rgb is None:
            return gr.skip(), gr.skip(), gr.skip(), shown
        try:
            feed = self.service.push_frame(request.session_hash, rgb, make_task(kind, question, ckind, ctext, regions=True),
                                      record=bool(record))
        except (UIError, VlmstreamError) as e:
            return frame_html(None, f"error: {e}"), gr.skip(), gr.skip(), shown
        snap = feed.snapshot()
        shots, shown = new_shots(snap.shots, shown)
        return (frame_html(snap), counters_html(snap.counters, self.service.engine_stats(), True, snap.error),
                gr.skip() if shots is None else shots_html(shots), shown)

    def cam_silent(self, shown: float | None, request: gr.Request):
        """The camera's counters once it stops sending (its own Stop, a camera unplugged): the
        page's updates came with its frames, and the last had left them saying "running". Once per
        silence (`shown`: the last push it was said for)."""
        feed = self.service.feed(request.session_hash, "push") if request else None
        if feed is None or feed.pushed_at == shown or time.monotonic() - feed.pushed_at < CAMERA_SILENT_S:
            return gr.skip(), shown
        self.service.live.camera_silent(request.session_hash)  # the other feeds take its frames in flight
        snap = feed.snapshot()
        return counters_html(snap.counters, self.service.engine_stats(), False, snap.error), feed.pushed_at

    def image(self, picture, kind, question, ckind, ctext, request: gr.Request = None):
        if picture is None:
            raise user_error("upload an image first")
        sid = getattr(request, "session_hash", None)
        activity.seen(sid, getattr(request, "username", None))
        try:
            task = make_task(kind, question, ckind, ctext)
            out = self.service.caption_image(as_rgb(picture), task)
        except (UIError, VlmstreamError) as e:
            raise user_error(str(e)) from None
        activity.image_answered(sid, task, out.get("timings_ms", {}).get("total", 0.0))
        return out["text"], out

    def locator(self, task: str):
        """The Image tab's Detect or Point button's handler."""
        def run(picture, what, request: gr.Request = None):
            return self.locate(picture, what, task, request)
        return run

    def locate(self, picture, what, task, request: gr.Request = None):
        if picture is None:
            raise user_error("upload an image first")
        if not (what or "").strip():
            raise user_error(f"say what to {task}: the object is empty")
        try:
            out = self.service.locate_image(as_rgb(picture), what, task)
        except VlmstreamError as e:
            raise user_error(str(e)) from None
        picture = out.pop("picture")
        sid = getattr(request, "session_hash", None)
        activity.seen(sid, getattr(request, "username", None))
        activity.image_located(sid, task, what, len(out["pixels"]))
        return f"{out[task]}: {places_text(out['pixels'], task)}", gr.Image(picture, visible=True), out

    def video(self, path, kind, question, every_n, ckind="none", ctext="", changes=False, request: gr.Request = None,
              progress=gr.Progress()):
        if not path:
            raise user_error("upload a video first")
        try:  # before the job's stop flag: a job that never starts must not leave one behind
            task = make_task(kind, question, ckind, ctext, regions=True)
            every = number(every_n, 1, "every n-th frame")
        except UIError as e:
            raise user_error(str(e)) from None
        sid = request.session_hash if request else "api"
        activity.seen(sid, getattr(request, "username", None))
        stop = self.service.jobs.stop_flag(sid)

        locating = kind in ("detect", "point")

        def on_progress(done: int, total: int | None) -> None:
            progress((min(done, total), total) if total else done, desc="locating" if locating else "captioning",
                     unit="frames")

        waiting = f"waiting: {VIDEO_SLOTS} video jobs run at once"
        if not self.service.jobs.wait_turn(stop, lambda: progress(None, desc=waiting)):
            self.service.jobs.forget(stop)
            return "cancelled before it started", None, None, None
        try:
            # its folder once it runs: made before, while it waited, other jobs' folders pushed it
            # out of the VIDEO_JOBS_KEPT newest, and it was deleted
            out_dir = self.service.jobs.new_folder()
            # the JSONL's "source" is the upload's name, as `video clip.mp4 -o` writes it: Gradio's
            # scratch path (/tmp/vlmstream-ui-.../gradio/<hash>/clip.mp4) is gone with the server
            activity.video_started(sid, Path(path).name, task, every)
            out = self.service.caption_video(path, task, out_dir, every, on_progress, stop=stop, changes=bool(changes),
                                             name=Path(path).name)
        except (UIError, VlmstreamError, OSError) as e:
            e = upload_named(e, path)
            activity.video_failed(sid, e)
            raise user_error(str(e)) from None
        finally:
            self.service.jobs.end_turn()
        rows = [[r["index"], round(r["pts"], 3), r["text"], r["ms"]] for r in out["rows"][:VIDEO_TABLE_ROWS]]
        # The note names its file: the results stay under the next file chosen, until its own job
        # starts, and "10 frames captioned" had read as that file's.
        note = (f"{markdown_text(Path(path).name)}: "
                f"{out['frames']} frame{'' if out['frames'] == 1 else 's'} {'located' if locating else 'captioned'} "
                f"in {out['seconds']} s "
                f"({out['x_real_time']}x real time)"
                + (f", {len(out['rows'])} {'count' if locating else 'answer'}{'' if len(out['rows']) == 1 else 's'} "
                   "that changed" if changes else "")
                + (" — cancelled; the downloads hold the frames done" if out["cancelled"] else "")
                + (f"\n\nthe table shows the first {VIDEO_TABLE_ROWS:,} of {len(out['rows']):,} answers; the "
                   "downloads hold them all" if len(out["rows"]) > VIDEO_TABLE_ROWS else "")
                # the upload by its name, as in errors: not by Gradio's scratch path
                + "".join(f"\n\nwarning: {upload_named(UIError(w), path)}" for w in out["warnings"]))
        activity.video_ended(sid, Path(path).name, out)
        p = out["paths"]
        return note, rows, [p[k] for k in ("srt", "vtt", "jsonl", "mp4") if k in p], p["mp4"]

    def cancel_video(self, request: gr.Request):
        self.service.jobs.cancel(request.session_hash)

    def closed(self, request: gr.Request):  # tab closed or reloaded: stop its feeds, cancel their requests
        self.autoplayed.pop(request.session_hash, None)
        self.paused.discard(request.session_hash)
        self.away.discard(request.session_hash)
        self.service.close_session(request.session_hash)
