"""`vlmstream ui`: the Gradio web UI (live view, browser webcam, video files, single images, settings).

One `Service` (one engine) per process, shared by every browser tab; each tab's live feeds are
keyed by its Gradio session and closed when the tab goes away. No engine logic here: tabs call
`app.service`, which calls the pipelines' public functions. Importing this module is cheap:
Gradio and the engine load when `build` or `run` is called.
"""

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

from app.service import RECORD_MAX_S, Service, Settings, UIError, sample_videos
from app.video_jobs import VIDEO_SLOTS
from app.task import make_task

PAGE_HZ = 12.0  # frame + caption updates per second pushed to a watching page (at most)
SLOW_HZ = 2.0  # chart, counters and log
MIN_GAP_S = 0.02
CAMERA_SILENT_S = 1.5  # a browser's camera sends a frame every 0.1 s: this long without one, it has stopped
# Updates Gradio holds for a page, unread: past BACKLOG_MAX the page's updates wait (a slow link
# gets fresh frames, not a growing delay); unread for ORPHAN_S, the feed stops. A feed started
# through the API by a client that never read its stream ran until the server stopped, its
# updates piling up in memory (3,000 in minutes), the engine busy for nobody.
BACKLOG_MAX = int(2 * PAGE_HZ)
ORPHAN_S = 60.0
DEFAULT_SAMPLE = "shapes_640x360_60fps.mp4"
PROMPTS = ["short", "normal", "long", "question"]
# The video tabs' (Live, Browser webcam, Video file): detect and point too, a frame at a time
# through the region decoder (a live source's newest frame when it is ready)
PLACE_PROMPTS = PROMPTS + ["detect", "point"]
CONSTRAINTS = ["none", "choices", "regex", "json schema"]
VIDEO_TABLE_ROWS = 5000  # a page holds this many; the downloads hold every answer


def video_file_types() -> list[str]:
    """What the upload fields accept: Gradio's "video" goes by MIME type, which rejected files
    FFmpeg reads (.ts, .mts/.m2ts from camcorders, .3gp, raw .h264): every extension `video`
    takes in a folder is named too."""
    from pipelines.sources import VIDEO_EXTENSIONS

    return ["video", *sorted(VIDEO_EXTENSIONS)]


QUESTION_LABEL = ("Question (several: one a line, all asked about every frame; a line's own constraint after its "
                  "question mark: [yes, no] or /regex/)")
OBJECT_QUESTION_LABEL = QUESTION_LABEL + "; for detect and point, the object (Moondream 2 weights)"
CONSTRAINT_LABEL = "Choices (comma separated), regex or JSON schema"


def build(service: Service, source: str | None = None):
    import gradio as gr

    from app.view import chart_svg, counters_html, frame_html, log_text, shots_html
    from engine import VlmstreamError
    from engine.request import as_rgb
    from pipelines.feed import EXPORT_LINES, SHOTS
    from pipelines.locator import places_text

    shots_label = (f"**Changes**: the frame where each new answer began, once it held a few frames (Settings) "
                   f"(newest first, the last {SHOTS}; click one to save it as shown, or download them all at full "
                   "size below)")
    shots_button = "Download change pictures (ZIP, full size)"
    shots_file_label = f"The last {SHOTS} change pictures, full size, with their answers (changes.jsonl)"

    samples = sample_videos()
    default_source = source or (DEFAULT_SAMPLE if DEFAULT_SAMPLE in samples else (samples[0] if samples else ""))

    # The sample a page plays on opening stops while the page is on another tab that works
    # (Browser webcam, Video file, Image), or hidden in the browser, and starts over back on Live:
    # it took 3/4 of the engine from those tabs (a video job beside it took 4x as long), and a page
    # left open in the background kept the cores busy for nobody. A feed the user started keeps
    # running (a camera watched for its changes, a recording).
    autoplayed: dict[str, object] = {}  # session -> its feed that the page's opening started
    paused: set[str] = set()  # sessions whose autoplayed feed waits for the Live tab
    away: set[str] = set()  # sessions whose page said last that it left Live (page_hidden)

    def live(src, upload, kind, question, ckind, ctext, record=False, request: gr.Request = None, auto=False):
        sid = request.session_hash
        try:
            task = make_task(kind, question, ckind, ctext, regions=True)
            feed = service.start_live(sid, upload or src, task, record=bool(record))
            if auto:
                autoplayed[sid] = feed
            else:
                autoplayed.pop(sid, None)
            paused.discard(sid)
            if auto and sid in away:  # the page left Live while this opened: leave_live found nothing to pause
                paused.add(sid)
                service.stop_live(sid)
        except (UIError, VlmstreamError, OSError) as e:
            # A bad form (an empty question) fails before start_live: the feed that plays (the
            # sample) is stopped too, else its frames covered the message within a page update.
            service.stop_live(sid)
            autoplayed.pop(sid, None)
            e = _upload_named(e, upload)
            # Again for two seconds: the previous feed's loop may have passed its check that it
            # still owns the page just before it was stopped, and its last frame must not land on
            # the message (once it did, in a browser test on a loaded machine, after 0.25 s).
            for _ in range(8):
                yield frame_html(None, f"error: {e}"), counters_html({}, service.engine_stats(), False, str(e)), \
                    gr.skip(), gr.skip(), gr.skip()
                time.sleep(0.25)
            return
        version, next_at, slow_at, shown = -1, time.monotonic(), 0.0, None
        stuck = None  # (updates unread, since when) while the page reads none of them
        try:
            while True:
                if service.feed(sid) is not feed:  # replaced by a new Start: that one owns the page now
                    if service.feed(sid) is None:  # stopped: make sure the page says so (and why)
                        snap = feed.snapshot()
                        yield gr.skip(), counters_html(snap.counters, service.engine_stats(), False, snap.error), \
                            gr.skip(), gr.skip(), gr.skip()
                    return
                now = time.monotonic()
                backlog = _unread(demo, sid)
                if backlog is not None and backlog >= BACKLOG_MAX:
                    if stuck is None or backlog < stuck[0]:  # read from since: not stuck
                        stuck = (backlog, now)
                    elif now - stuck[1] > ORPHAN_S:
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
                    shots, shown = _new_shots(snap.shots, shown)
                    yield (frame, counters_html(snap.counters, service.engine_stats(), snap.running, snap.error),
                           chart_svg(snap.latency, feed.window_s), log_text(snap.log),
                           gr.skip() if shots is None else shots_html(shots))
                else:
                    yield frame, gr.skip(), gr.skip(), gr.skip(), gr.skip()
                if not snap.running:
                    return
                next_at += 1.0 / PAGE_HZ  # a steady rate, not work + sleep; never a busy catch-up
                now = time.monotonic()
                next_at = max(next_at, now + MIN_GAP_S)
                time.sleep(next_at - now)
        finally:  # the page went away (or Stop): nothing keeps running for nobody
            if service.feed(sid) is feed:
                service.stop_live(sid)

    # Gradio passes the request to a parameter annotated gr.Request, not to one after *args
    def autoplay(src, upload, kind, question, ckind, ctext, record=False, request: gr.Request = None):
        yield from live(src, upload, kind, question, ckind, ctext, record, request, auto=True)

    def leave_live(request: gr.Request):
        sid = request.session_hash
        away.add(sid)
        feed = service.feed(sid)
        if feed is not None and autoplayed.get(sid) is feed:
            paused.add(sid)
            service.stop_live(sid)

    def back_to_live(src, upload, kind, question, ckind, ctext, record=False, request: gr.Request = None):
        away.discard(request.session_hash)
        if request.session_hash in paused and service.feed(request.session_hash) is None:
            yield from live(src, upload, kind, question, ckind, ctext, record, request, auto=True)
        else:
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()

    def stop(request: gr.Request):
        feed = service.feed(request.session_hash)
        service.stop_live(request.session_hash)
        if feed is None:
            return gr.skip()
        snap = feed.snapshot()
        return counters_html(snap.counters, service.engine_stats(), False, snap.error)

    def download(make_file, kind: str):
        """A button's handler: the file `make_file(session, kind)` writes (captions, a recording)."""
        def run(request: gr.Request):
            try:
                return str(make_file(request.session_hash, kind))
            except UIError as e:
                raise _user_error(str(e)) from None
        return run

    def webcam(rgb, kind, question, ckind, ctext, record, shown, request: gr.Request):
        if rgb is None:
            return gr.skip(), gr.skip(), gr.skip(), shown
        try:
            feed = service.push_frame(request.session_hash, rgb, make_task(kind, question, ckind, ctext, regions=True),
                                      record=bool(record))
        except (UIError, VlmstreamError) as e:
            return frame_html(None, f"error: {e}"), gr.skip(), gr.skip(), shown
        snap = feed.snapshot()
        shots, shown = _new_shots(snap.shots, shown)
        return (frame_html(snap), counters_html(snap.counters, service.engine_stats(), True, snap.error),
                gr.skip() if shots is None else shots_html(shots), shown)

    def cam_silent(shown: float | None, request: gr.Request):
        """The camera's counters once it stops sending (its own Stop, a camera unplugged): the
        page's updates came with its frames, and the last had left them saying "running". Once per
        silence (`shown`: the last push it was said for)."""
        feed = service.feed(request.session_hash, "push") if request else None
        if feed is None or feed.pushed_at == shown or time.monotonic() - feed.pushed_at < CAMERA_SILENT_S:
            return gr.skip(), shown
        snap = feed.snapshot()
        return counters_html(snap.counters, service.engine_stats(), False, snap.error), feed.pushed_at

    def image(picture, kind, question, ckind, ctext):
        if picture is None:
            raise _user_error("upload an image first")
        try:
            out = service.caption_image(as_rgb(picture), make_task(kind, question, ckind, ctext))
        except (UIError, VlmstreamError) as e:
            raise _user_error(str(e)) from None
        return out["text"], out

    def locate(picture, what, task):
        if picture is None:
            raise _user_error("upload an image first")
        if not (what or "").strip():
            raise _user_error(f"say what to {task}: the object is empty")
        try:
            out = service.locate_image(as_rgb(picture), what, task)
        except VlmstreamError as e:
            raise _user_error(str(e)) from None
        picture = out.pop("picture")
        return f"{out[task]}: {places_text(out['pixels'], task)}", gr.Image(picture, visible=True), out

    def video(path, kind, question, every_n, ckind="none", ctext="", changes=False, request: gr.Request = None,
              progress=gr.Progress()):
        if not path:
            raise _user_error("upload a video first")
        try:  # before the job's stop flag: a job that never starts must not leave one behind
            task = make_task(kind, question, ckind, ctext, regions=True)
            every = _number(every_n, 1, "every n-th frame")
        except UIError as e:
            raise _user_error(str(e)) from None
        stop = service.jobs.stop_flag(request.session_hash if request else "api")

        locating = kind in ("detect", "point")

        def on_progress(done: int, total: int | None) -> None:
            progress((min(done, total), total) if total else done, desc="locating" if locating else "captioning",
                     unit="frames")

        waiting = f"waiting: {VIDEO_SLOTS} video jobs run at once"
        if not service.jobs.wait_turn(stop, lambda: progress(None, desc=waiting)):
            service.jobs.forget(stop)
            return "cancelled before it started", None, None, None
        try:
            # its folder once it runs: made before, while it waited, other jobs' folders pushed it
            # out of the VIDEO_JOBS_KEPT newest, and it was deleted
            out_dir = service.jobs.new_folder()
            out = service.caption_video(path, task, out_dir, every, on_progress, stop=stop, changes=bool(changes))
        except (UIError, VlmstreamError, OSError) as e:
            raise _user_error(str(_upload_named(e, path))) from None
        finally:
            service.jobs.end_turn()
        rows = [[r["index"], round(r["pts"], 3), r["text"], r["ms"]] for r in out["rows"][:VIDEO_TABLE_ROWS]]
        note = (f"{out['frames']} frame{'' if out['frames'] == 1 else 's'} {'located' if locating else 'captioned'} "
                f"in {out['seconds']} s "
                f"({out['x_real_time']}x real time)"
                + (f", {len(out['rows'])} {'count' if locating else 'answer'}{'' if len(out['rows']) == 1 else 's'} "
                   "that changed" if changes else "")
                + (" — cancelled; the downloads hold the frames done" if out["cancelled"] else "")
                + (f"\n\nthe table shows the first {VIDEO_TABLE_ROWS:,} of {len(out['rows']):,} answers; the "
                   "downloads hold them all" if len(out["rows"]) > VIDEO_TABLE_ROWS else "")
                # the upload by its name, as in errors: not by Gradio's scratch path
                + "".join(f"\n\nwarning: {_upload_named(UIError(w), path)}" for w in out["warnings"]))
        p = out["paths"]
        return note, rows, [p[k] for k in ("srt", "vtt", "jsonl", "mp4") if k in p], p["mp4"]

    def cancel_video(request: gr.Request):
        service.jobs.cancel(request.session_hash)

    def apply(model, device, temperature, max_tokens, pipelined, sticky=Settings.sticky, hold=Settings.hold):
        try:
            # A box left empty comes as None: the setting as it is (float(None) escaped as a TypeError).
            now = service.settings
            msg = service.apply(Settings(model=(model or "tiny").strip(), device=device, dtype=now.dtype,
                                         temperature=_number(temperature, now.temperature, "temperature"),
                                         max_tokens=_number(max_tokens, now.max_tokens, "max tokens"),
                                         pipelined=bool(pipelined), sticky=_number(sticky, now.sticky, "steadiness"),
                                         hold=_number(hold, now.hold, "frames a change holds")))
        except (UIError, VlmstreamError, OSError) as e:
            raise _user_error(str(e)) from None
        return msg

    # Gradio keeps its own copies of uploads and results; hourly, those older than a day go, and all
    # of them when the server stops (a long-running server must not fill the disk).
    with gr.Blocks(title="vlmstream", analytics_enabled=False, delete_cache=(3600, 86400)) as demo:
        gr.Markdown("# vlmstream\nReal-time video understanding: every frame captioned by a vision-language model.")
        with gr.Row():  # clicked by the page itself when it is hidden or shown (HEAD_JS; CSS hides them)
            page_hidden = gr.Button("pause", elem_id="vs-page-hidden")
            page_shown = gr.Button("resume", elem_id="vs-page-shown")
        with gr.Tab("Live", elem_id="vs-tab-live"):
            with gr.Row():
                src = gr.Dropdown(samples + ["webcam:0"], value=default_source, allow_custom_value=True, scale=3,
                                  label="Source: a sample, a webcam index on the server, a URL or a path")
                upload = gr.File(label="...or a video file to play live", file_types=video_file_types(), type="filepath",
                                 scale=2)
            with gr.Row():
                kind = gr.Radio(PLACE_PROMPTS, value="short", label="Prompt")
                question = gr.Textbox(label=OBJECT_QUESTION_LABEL, placeholder="How many shapes are there? [one, two, three, four]", lines=2)
                ckind = gr.Dropdown(CONSTRAINTS, value="none", label="Constraint")
                ctext = gr.Textbox(label=CONSTRAINT_LABEL)
            with gr.Row():
                start = gr.Button("Start", variant="primary", elem_id="vs-start")
                stop_btn = gr.Button("Stop", elem_id="vs-stop")
                record = gr.Checkbox(False, label=f"Record from Start (MP4 with the captions drawn, the first "
                                                  f"{RECORD_MAX_S / 60:g} minutes)", elem_id="vs-record")
            with gr.Row():
                with gr.Column(scale=3):
                    frame = gr.HTML(frame_html(None), elem_id="vs-frame-box")
                with gr.Column(scale=2):
                    counters = gr.HTML(elem_id="vs-counters-box")
                    log = gr.Textbox(label="Captions, a line each time they change (newest first)", lines=14,
                                     max_lines=14, elem_id="vs-log")
            chart = gr.HTML(chart_svg([], 30.0), elem_id="vs-chart-box")
            gr.Markdown(shots_label)
            shots = gr.HTML(shots_html([]), elem_id="vs-shots-box")
            with gr.Row():
                shots_btn = gr.Button(shots_button, elem_id="vs-shots-zip", scale=1)
                shots_file = gr.File(label=shots_file_label, elem_id="vs-shots-zip-file", scale=3,
                                     elem_classes="vs-download")
            shots_btn.click(download(service.export_shots, "pull"),
                            None, shots_file, api_name="export_changes", concurrency_limit=None)
            with gr.Row():
                export_btn = gr.Button("Export captions (JSONL)", elem_id="vs-export", scale=1)
                export_file = gr.File(label=f"Captions of this session (the last {EXPORT_LINES:,}, with timings)",
                                      elem_id="vs-export-file", scale=3, elem_classes="vs-download")
            export_btn.click(download(service.export_log, "pull"),
                             None, export_file, api_name="export_live", concurrency_limit=None)
            with gr.Row():
                rec_btn = gr.Button("Download recording (MP4; ends a recording still running)",
                                    elem_id="vs-recording", scale=1)
                rec_file = gr.File(label="Recording of this session", elem_id="vs-recording-file", scale=3,
                                   elem_classes="vs-download")
            rec_btn.click(download(service.recording, "pull"),
                          None, rec_file, api_name="live_recording", concurrency_limit=None)
            live_inputs = [src, upload, kind, question, ckind, ctext, record]
            live_outputs = [frame, counters, chart, log, shots]
            # also an API: gradio_client can follow a live source (frame HTML, counters, chart, log,
            # pictures of the changes)
            # "multiple": a Start while the user's own feed runs replaces it (Gradio's default,
            # "once", dropped the click for as long as the running feed's event lasted: for ever)
            start.click(live, live_inputs, live_outputs, concurrency_limit=None, show_progress="hidden",
                        api_name="live", trigger_mode="multiple")
            stop_btn.click(stop, None, counters, api_name=False, concurrency_limit=None)
            if default_source:
                demo.load(autoplay, live_inputs, live_outputs, concurrency_limit=None, show_progress="hidden",
                          api_name=False)
        with gr.Tab("Browser webcam", elem_id="vs-tab-webcam"):
            # Shown only where the browser withholds the camera (HEAD_JS marks such pages).
            gr.HTML('<div class="vs-error">This page was opened over plain HTTP from another machine, and '
                    'browsers give the camera only to pages served over HTTPS (or from localhost): start '
                    'the UI with --ssl-certfile and --ssl-keyfile (README) and open it with https://.</div>',
                    elem_id="vs-cam-insecure")
            with gr.Row():
                cam = gr.Image(sources=["webcam"], streaming=True, type="numpy", label="Your camera",
                               elem_id="vs-cam")
                with gr.Column():
                    cam_frame = gr.HTML(frame_html(None, "start your camera"), elem_id="vs-cam-frame")
                    cam_counters = gr.HTML()
            with gr.Row():
                cam_kind = gr.Radio(PLACE_PROMPTS, value="short", label="Prompt", elem_id="vs-cam-kind")
                cam_question = gr.Textbox(label=OBJECT_QUESTION_LABEL, lines=2, elem_id="vs-cam-question")
                cam_ckind = gr.Dropdown(CONSTRAINTS, value="none", label="Constraint")
                cam_ctext = gr.Textbox(label=CONSTRAINT_LABEL)
            with gr.Row():
                cam_export = gr.Button("Export captions (JSONL)", scale=1)
                cam_file = gr.File(label=f"Captions of your camera (the last {EXPORT_LINES:,}, with timings)", scale=3,
                                   elem_classes="vs-download")
            cam_export.click(download(service.export_log, "push"),
                             None, cam_file, api_name=False, concurrency_limit=None)
            with gr.Row():
                cam_record = gr.Checkbox(False, label=f"Record (MP4 with the captions drawn, up to "
                                                      f"{RECORD_MAX_S / 60:g} minutes; untick to finish)",
                                         elem_id="vs-cam-record", scale=1)
                cam_rec_btn = gr.Button("Download recording (MP4; ends a recording still running)",
                                        elem_id="vs-cam-recording", scale=1)
                cam_rec_file = gr.File(label="Recording of your camera", elem_id="vs-cam-recording-file", scale=2,
                                       elem_classes="vs-download")
            cam_rec_btn.click(download(service.recording, "push"),
                              None, cam_rec_file, api_name=False, concurrency_limit=None)
            gr.Markdown(shots_label)
            cam_shots = gr.HTML(shots_html([]), elem_id="vs-cam-shots-box")
            with gr.Row():
                cam_shots_btn = gr.Button(shots_button, elem_id="vs-cam-shots-zip", scale=1)
                cam_shots_file = gr.File(label=shots_file_label, elem_id="vs-cam-shots-zip-file", scale=3,
                                         elem_classes="vs-download")
            cam_shots_btn.click(download(service.export_shots, "push"),
                                None, cam_shots_file, api_name=False, concurrency_limit=None)
            cam_shown = gr.State(None)  # the newest change picture the page shows (see _new_shots)
            cam.stream(webcam, [cam, cam_kind, cam_question, cam_ckind, cam_ctext, cam_record, cam_shown],
                       [cam_frame, cam_counters, cam_shots, cam_shown], stream_every=0.1, concurrency_limit=None,
                       show_progress="hidden", api_name=False)
            cam_silence = gr.State(None)
            gr.Timer(1.0).tick(cam_silent, cam_silence, [cam_counters, cam_silence], api_name=False,
                               concurrency_limit=None, show_progress="hidden")
        with gr.Tab("Video file", elem_id="vs-tab-video"):
            with gr.Row():
                vfile = gr.File(label="Video", file_types=video_file_types(), type="filepath", elem_id="vs-video-file")
                with gr.Column():
                    vkind = gr.Radio(PLACE_PROMPTS, value="short", label="Prompt", elem_id="vs-video-kind")
                    vquestion = gr.Textbox(label=OBJECT_QUESTION_LABEL, lines=2, elem_id="vs-video-question")
                    vckind = gr.Dropdown(CONSTRAINTS, value="none", label="Constraint")
                    vctext = gr.Textbox("", label=CONSTRAINT_LABEL)
                    # step, not precision=0: that rounded 1.5 to 2 before the job's check could say it is no whole number
                    every = gr.Number(1, step=1, label="Every n-th frame")  # checked by the job: one line, no trace
                    vchanges = gr.Checkbox(False, label="Only the answers that change (a table of events; the "
                                                        "JSONL too)", elem_id="vs-video-changes")
                    with gr.Row():
                        vrun = gr.Button("Caption video", variant="primary", elem_id="vs-video-run")
                        vcancel = gr.Button("Cancel", elem_id="vs-video-cancel")
            vnote = gr.Markdown(elem_id="vs-video-note")
            vtable = gr.Dataframe(headers=["frame", "time (s)", "caption", "ms"], wrap=True, elem_id="vs-video-table")
            vfiles = gr.File(label="Downloads (SRT, VTT, JSONL, annotated MP4; detect and point: JSONL, MP4)",
                             file_count="multiple")
            vvideo = gr.Video(label="Annotated video")
            # The previous job's results go when a new one starts: a job that then failed left them
            # under its error, "90 frames captioned" beside the new file's "empty (0 bytes)".
            vrun.click(lambda: ("", None, None, None), None, [vnote, vtable, vfiles, vvideo], queue=False,
                       api_name=False, show_progress="hidden")
            # not Gradio's concurrency limit: a job waiting for a slot must already answer Cancel
            # (VideoJobs.wait_turn)
            vrun.click(video, [vfile, vkind, vquestion, every, vckind, vctext, vchanges], [vnote, vtable, vfiles, vvideo],
                       api_name="caption_video", concurrency_limit=None)
            # also an API: a gradio_client's job.cancel() cannot stop a running job (Gradio ends the
            # event, not the work); /cancel_video from the same Client does
            vcancel.click(cancel_video, None, None, api_name="cancel_video", concurrency_limit=None)
        with gr.Tab("Image", elem_id="vs-tab-image"):
            with gr.Row():
                # As uploaded, read as `vlmstream image` reads a file (Gradio's RGB conversion
                # showed what lies under transparent pixels; a palette came as its indices)
                img = gr.Image(type="pil", image_mode=None, label="Image")
                img.preprocess = _read_in_one_line(img.preprocess)
                with gr.Column():
                    ikind = gr.Radio(PROMPTS, value="normal", label="Prompt")
                    iquestion = gr.Textbox(label=QUESTION_LABEL, lines=2)
                    ickind = gr.Dropdown(CONSTRAINTS, value="none", label="Constraint")
                    ictext = gr.Textbox(label=CONSTRAINT_LABEL)
                    irun = gr.Button("Caption", variant="primary")
                    with gr.Row():  # the region head: Moondream 2 weights (the tiny model's is untrained)
                        iobject = gr.Textbox(label="Object to detect or point at (Moondream 2 weights)", scale=2)
                        idetect = gr.Button("Detect", elem_id="vs-image-detect")
                        ipoint = gr.Button("Point", elem_id="vs-image-point")
            itext = gr.Textbox(label="Answer", elem_id="vs-image-text")
            iplaces = gr.Image(label="Places", visible=False, interactive=False, format="png")  # crisp lines
            itimings = gr.JSON(label="Result and timings")
            irun.click(image, [img, ikind, iquestion, ickind, ictext], [itext, itimings], api_name="caption_image",
                       concurrency_limit=None)
            for button, task in ((idetect, "detect"), (ipoint, "point")):
                button.click(lambda rgb, what, task=task: locate(rgb, what, task), [img, iobject],
                             [itext, iplaces, itimings], api_name=f"{task}_image", concurrency_limit=None)
        with gr.Tab("Settings", elem_id="vs-tab-settings"):
            s = service.settings
            with gr.Row():
                model = gr.Textbox(s.model, label="Model: tiny or a Moondream 2 folder")
                device = gr.Dropdown(["cpu", "cuda"], value=s.device, label="Device")
            with gr.Row():
                temperature = gr.Slider(0.0, 2.0, value=s.temperature, step=0.05, label="Temperature (0 = greedy)")
                max_tokens = gr.Number(s.max_tokens, step=1, label="Max tokens")  # checked by apply(), as every n-th
                pipelined = gr.Checkbox(s.pipelined, label="Pipelined decoding (off = blocking loop)")
            sticky = gr.Slider(0.0, 10.0, value=s.sticky, step=0.5,
                               label="Steady answers (live and video): keep the last frame's answer unless the model "
                                     "prefers another by more than this (logits; 0 = every frame's own answer; "
                                     "greedy only)")
            hold = gr.Number(s.hold, step=1,  # 1..600, checked by apply()
                             label="Changes (live tabs): a new answer gets a picture once it has held this many "
                                   "frames in a row (1 = every change; from the next Start)")
            sapply = gr.Button("Apply", variant="primary")
            sstatus = gr.Markdown()
            stats = gr.JSON(label="Engine")
            sapply.click(apply, [model, device, temperature, max_tokens, pipelined, sticky, hold], sstatus,
                         api_name="apply_settings")
            gr.Timer(1.0).tick(service.engine_stats, None, stats, api_name="engine_stats", show_progress="hidden")
        # The page says where it is (HEAD_JS: after tab switches and visibility changes settle):
        # tabs' own select events, run side by side, left a quick Video file -> Live stopped.
        page_hidden.click(leave_live, None, None, api_name=False, concurrency_limit=None, show_progress="hidden",
                          trigger_mode="multiple")
        page_shown.click(back_to_live, live_inputs, live_outputs, api_name=False, concurrency_limit=None,
                         show_progress="hidden", trigger_mode="multiple")

        def closed(request: gr.Request):  # tab closed or reloaded: stop its feeds, cancel their requests
            autoplayed.pop(request.session_hash, None)
            paused.discard(request.session_hash)
            away.discard(request.session_hash)
            service.close_session(request.session_hash)

        demo.unload(closed)
        for block in demo.blocks.values():
            if isinstance(block, (gr.Slider, gr.Radio, gr.Dropdown, gr.File, gr.Checkbox)):
                name = re.split(r" \(|:", block.label or "a value")[0]  # "Temperature (0 = greedy)": Temperature
                block.preprocess = _value_in_one_line(block.preprocess, name)
    demo.queue(default_concurrency_limit=None)
    return demo


def _value_in_one_line(preprocess: Callable, label: str) -> Callable:
    """A form input's preprocess whose refusal of an API caller's value (temperature None or 5, a
    prompt kind "Normal", a device "gpu", a video field given a PNG) is one line naming the field,
    with no traceback in the server's console (Gradio printed one or two for each, and a
    TypeError's paragraph of its internals for a value of the wrong type)."""
    import gradio as gr

    def read(payload):
        try:
            return preprocess(payload)
        except gr.Error as e:
            raise _user_error(f"{label}: {str(e.message).splitlines()[0]}") from None
        except (TypeError, ValueError) as e:
            raise _user_error(f"{label}: {payload!r:.40} is not a valid value ({type(e).__name__})") from None

    return read


def _unread(demo, session: str) -> int | None:
    """The updates Gradio holds for a page that its stream has not read yet (None where this
    Gradio keeps them elsewhere: its queue's internals, read defensively)."""
    try:
        pending = demo._queue.pending_messages_per_session.get(session)
        return None if pending is None else int(pending.qsize())
    except Exception:  # another Gradio: no backpressure, as before
        return None


def _read_in_one_line(preprocess: Callable) -> Callable:
    """An Image component's preprocess, whose upload Pillow cannot read (not an image, a
    decompression bomb) is said in one line with the file's name, as `vlmstream image` says it:
    Gradio's own error was a paragraph of its internals naming its scratch path, with a traceback
    in the server's console. (A subclass of gr.Image would do it too, but Gradio writes a .pyi
    file beside its module.)"""
    from engine.errors import ImageError
    from pipelines.image_file import check_image

    def read(payload):
        try:
            return preprocess(payload)
        except Exception as e:
            path = str(getattr(payload, "path", "") or "")
            try:
                if path:
                    check_image(path)  # why, in the words of the command line's reading
            except ImageError as why:
                raise _user_error(str(_upload_named(why, path)).splitlines()[0]) from None
            raise _user_error(str(_upload_named(e, path)).splitlines()[0] or type(e).__name__) from None

    return read


def _upload_named(e: Exception, path: str | None) -> Exception:
    """The error with an uploaded file named by its name, not by Gradio's scratch path
    (/tmp/gradio/be5207.../clip.mp4 is not a readable video...)."""
    if not path or path not in str(e):
        return e
    return UIError(str(e).replace(path, Path(path).name))


def _user_error(message: str) -> Exception:
    """A mistake of the page's user: said on the page in one line, and not logged with a traceback
    in the server's console (Gradio printed one for every such error)."""
    import gradio as gr

    return gr.Error(message, print_exception=False)


def _number(value, default: int | float, what: str) -> int | float:
    """A number box's value: empty (None) keeps `default`; else a finite number, whole where
    `default` is (a whole one that is not is left for the check that says so)."""
    if value is None or value == "":
        return default
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise UIError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise UIError(f"{what} must be a finite number, got {value!r}")
    return int(x) if isinstance(default, int) and x == int(x) else x


def _new_shots(shots: list, shown: float | None) -> tuple[list | None, float | None]:
    """(the feed's change pictures if the page lacks some, else None; what the page then shows):
    pictures go to a page only when there are new ones. `shown` is the newest picture's time
    (unique across the feeds a page may follow, whose change numbers each start at 1)."""
    if not shots or shots[-1].wall == shown:
        return None, shown
    return shots, shots[-1].wall


def run(args: argparse.Namespace) -> int:
    from app.cli import UsageError, reading_arg, realtime_dtype
    from app.listen import check_port, loopback, read_auth, tls_arguments
    from app.view import CSS, HEAD_JS
    from pipelines.stream import is_named_pipe

    if not 0 < args.port < 65536:
        raise UsageError("--port must be within 1..65535")
    if args.source == "-":
        raise UsageError("--source -: the web UI does not read standard input (`vlmstream live -` does)")
    if args.source and is_named_pipe(args.source):  # read once, where every page's Start opens its source
        raise UsageError(f"--source {args.source}: the web UI does not read a named pipe "
                         f"(`vlmstream live {args.source}` does)")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls from this machine
    check_port(args.host, args.port)  # a port in use is one line, before the model loads
    tls = tls_arguments(args.ssl_certfile, args.ssl_keyfile)
    auth = read_auth(args.auth_file) if args.auth_file else None
    if auth is None and not loopback(args.host):
        print(f"vlmstream: warning: the UI on {args.host} asks no password, and its page plays any file or URL "
              "this server reaches (--auth-file)", file=sys.stderr)
    if args.source and args.source not in sample_videos():
        from pipelines.sources import open_live

        open_live(args.source)  # a missing file or camera, a bad URL scheme: SourceError, exit 2
    dtype = realtime_dtype(args.device, args.dtype)
    service = Service(Settings(model=args.model, device=args.device, dtype=dtype), reading_arg(args))
    # Gradio's copies of uploads and results in this server's own folder, removed with it when the
    # server stops (in /tmp/gradio they stayed: exports, recordings, every video job's files).
    # Unset again at the end: a second server in this process (tests) must not inherit a removed folder.
    own_temp = "GRADIO_TEMP_DIR" not in os.environ
    if own_temp:
        os.environ["GRADIO_TEMP_DIR"] = str(service.jobs.scratch() / "gradio")
    demo = None
    try:
        service.engine()  # a bad --model fails here, in one line, before the server starts
        demo = build(service, args.source)
        # ssl_verify=False: Gradio's own request to the new server must accept a self-signed
        # certificate (the usual one on a LAN); browsers make their own choice.
        demo.launch(server_name=args.host, server_port=args.port, css=CSS, head=HEAD_JS, ssr_mode=False,
                    quiet=False, show_error=True, **tls, ssl_verify=not tls, auth=auth,
                    auth_message="vlmstream" if auth else None, max_file_size=args.max_upload,
                    prevent_thread_lock=True)
        # Our own wait: Gradio's took Ctrl-C (and SIGTERM, raised as it) for a normal end, exit 0.
        # A KeyboardInterrupt goes on up to `main`: one line, and 130 or 143 as `video` and `live`.
        while demo.is_running:
            time.sleep(0.1)
    finally:
        # Each step whatever the one before did: a second Ctrl-C while the server closes (~1-2 s)
        # cut this block short, and the scratch folder (every video job's outputs, recordings,
        # exports, Gradio's copies of uploads) stayed in /tmp
        try:
            if demo is not None:
                demo.close(verbose=False)
        finally:
            try:
                service.close()
            finally:
                service.remove_outputs()
                if own_temp:
                    os.environ.pop("GRADIO_TEMP_DIR", None)
    return 0
