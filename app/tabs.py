"""The web UI's tabs (Live, Browser webcam, Video file, Image, Settings): each function lays out
its components inside the `gr.Tab` that `app.ui.build` opened, and wires them to the page's events
(`app.page_events.PageEvents`).
"""

from typing import Callable

import gradio as gr

from app.live_sessions import RECORD_MAX_S
from app.page_events import PageEvents
from app.page_values import upload_named, user_error
from app.view import chart_svg, frame_html, shots_html
from pipelines.feed import EXPORT_LINES, SHOTS

PROMPTS = ["short", "normal", "long", "question"]
# The video tabs' (Live, Browser webcam, Video file): detect and point too, a frame at a time
# through the region decoder (a live source's newest frame when it is ready)
PLACE_PROMPTS = PROMPTS + ["detect", "point"]
CONSTRAINTS = ["none", "choices", "regex", "json schema"]
QUESTION_LABEL = ("Question (several: one a line, all asked about every frame; a line's own constraint after its "
                  "question mark: [yes, no] or /regex/)")
OBJECT_QUESTION_LABEL = QUESTION_LABEL + "; for detect and point, the object (Moondream 2 weights)"
CONSTRAINT_LABEL = "Choices (comma separated), regex or JSON schema"
SHOTS_LABEL = (f"**Changes**: the frame where each new answer began, once it held a few frames (Settings) "
               f"(newest first, the last {SHOTS}; click one to save it as shown, or download them all at full "
               "size below)")
SHOTS_BUTTON = "Download change pictures (ZIP, full size)"
SHOTS_FILE_LABEL = f"The last {SHOTS} change pictures, full size, with their answers (changes.jsonl)"


def video_file_types() -> list[str]:
    """What the upload fields accept: Gradio's "video" goes by MIME type, which rejected files
    FFmpeg reads (.ts, .mts/.m2ts from camcorders, .3gp, raw .h264): every extension `video`
    takes in a folder is named too."""
    from pipelines.sources import VIDEO_EXTENSIONS

    return ["video", *sorted(VIDEO_EXTENSIONS)]


def _prompt_form(prompts: list[str], question_label: str, elem_id: str | None = None, value: str = "short",
                 placeholder: str | None = None) -> tuple:
    """A tab's prompt, question(s) and constraint fields, in the order its handlers take them."""
    kind = gr.Radio(prompts, value=value, label="Prompt", elem_id=elem_id and f"{elem_id}-kind")
    question = gr.Textbox(label=question_label, lines=2, elem_id=elem_id and f"{elem_id}-question",
                          placeholder=placeholder)
    ckind = gr.Dropdown(CONSTRAINTS, value="none", label="Constraint")
    ctext = gr.Textbox("", label=CONSTRAINT_LABEL)
    return kind, question, ckind, ctext


def _download_row(button: str, label: str, elem_id: str | None, make_file: Callable,
                  api_name: str | bool) -> None:
    """A button and the file field its click fills (captions, change pictures, a recording)."""
    with gr.Row():
        btn = gr.Button(button, elem_id=elem_id, scale=1)
        out = gr.File(label=label, elem_id=elem_id and f"{elem_id}-file", scale=3, elem_classes="vs-download")
    btn.click(make_file, None, out, api_name=api_name, concurrency_limit=None)


def live_tab(events: PageEvents, samples: list[str], default_source: str) -> tuple[list, list]:
    """The Live tab: a source played live. Returns its Start's inputs and outputs (the page's
    coming back to Live restarts its sample with them)."""
    service = events.service
    listed = service.sources
    with gr.Row():
        # --listed-only: nothing typed in (the server's own refusal stands behind this: app.source_list)
        src = gr.Dropdown([*listed.named, *samples, *([] if listed.only else ["webcam:0"])], value=default_source,
                          allow_custom_value=not listed.only, scale=3,
                          label="Source: a camera of this server's list, or a sample" if listed.only else
                                "Source: a sample, a webcam index on the server, a URL or a path")
        upload = gr.File(label="...or a video file to play live", file_types=video_file_types(), type="filepath",
                         scale=2)
    with gr.Row(elem_classes="vs-prompt-row"):  # stacked on a narrow window (page_head.CSS)
        kind, question, ckind, ctext = _prompt_form(PLACE_PROMPTS, OBJECT_QUESTION_LABEL,
                                                    placeholder="How many shapes are there? [one, two, three, four]")
    with gr.Row():
        start = gr.Button("Start", variant="primary", elem_id="vs-start")
        stop_btn = gr.Button("Stop", elem_id="vs-stop")
        record = gr.Checkbox(False, label=f"Record from Start (MP4 with the captions drawn, the first "
                                          f"{RECORD_MAX_S / 60:g} minutes)", elem_id="vs-record")
    # On a narrow window (a phone) the frame comes first, above the controls (page_head.CSS)
    with gr.Row(elem_id="vs-frame-row"):
        with gr.Column(scale=3, elem_id="vs-frame-col"):
            frame = gr.HTML(frame_html(None), elem_id="vs-frame-box")
        with gr.Column(scale=2):
            counters = gr.HTML(elem_id="vs-counters-box")
            log = gr.Textbox(label="Captions, a line each time they change (newest first)", lines=14,
                             max_lines=14, elem_id="vs-log")
    chart = gr.HTML(chart_svg([], 30.0), elem_id="vs-chart-box")
    gr.Markdown(SHOTS_LABEL)
    shots = gr.HTML(shots_html([]), elem_id="vs-shots-box")
    _download_row(SHOTS_BUTTON, SHOTS_FILE_LABEL, "vs-shots-zip", events.download(service.export_shots, "pull"),
                  "export_changes")
    _download_row("Export captions (JSONL)", f"Captions of this session (the last {EXPORT_LINES:,}, with timings)",
                  "vs-export", events.download(service.export_log, "pull"), "export_live")
    _download_row("Download recording (MP4; ends a recording still running)", "Recording of this session",
                  "vs-recording", events.download(service.recording, "pull"), "live_recording")
    live_inputs = [src, upload, kind, question, ckind, ctext, record]
    live_outputs = [frame, counters, chart, log, shots]
    # also an API: gradio_client can follow a live source (frame HTML, counters, chart, log,
    # pictures of the changes)
    # "multiple": a Start while the user's own feed runs replaces it (Gradio's default,
    # "once", dropped the click for as long as the running feed's event lasted: for ever)
    start.click(events.live, live_inputs, live_outputs, concurrency_limit=None, show_progress="hidden",
                api_name="live", trigger_mode="multiple")
    stop_btn.click(events.stop, None, counters, api_name=False, concurrency_limit=None)
    # A source chosen (or typed) after an upload is the one to play: Start takes an upload first,
    # and the upload left in its box had played on in place of the sample the user picked.
    src.input(lambda: None, None, upload, queue=False, api_name=False, show_progress="hidden")
    if default_source:
        events.demo.load(events.autoplay, live_inputs, live_outputs, concurrency_limit=None, show_progress="hidden",
                         api_name=False)
    return live_inputs, live_outputs


def webcam_tab(events: PageEvents) -> None:
    """The Browser webcam tab: the page's own camera, its frames pushed to the server."""
    service = events.service
    # Shown only where the browser withholds the camera (HEAD_JS marks such pages).
    gr.HTML('<div class="vs-error">This page was opened over plain HTTP from another machine, and '
            'browsers give the camera only to pages served over HTTPS (or from localhost): start '
            'the UI with --ssl-certfile and --ssl-keyfile (README) and open it with https://.</div>',
            elem_id="vs-cam-insecure")
    with gr.Row():
        cam = gr.Image(sources=["webcam"], streaming=True, type="numpy", label="Your camera", elem_id="vs-cam")
        with gr.Column():
            cam_frame = gr.HTML(frame_html(None, "start your camera"), elem_id="vs-cam-frame")
            cam_counters = gr.HTML()
    with gr.Row(elem_classes="vs-prompt-row"):  # stacked on a narrow window (page_head.CSS)
        form = _prompt_form(PLACE_PROMPTS, OBJECT_QUESTION_LABEL, "vs-cam")
    _download_row("Export captions (JSONL)", f"Captions of your camera (the last {EXPORT_LINES:,}, with timings)",
                  None, events.download(service.export_log, "push"), False)
    with gr.Row():
        cam_record = gr.Checkbox(False, label=f"Record (MP4 with the captions drawn, up to "
                                              f"{RECORD_MAX_S / 60:g} minutes; untick to finish)",
                                 elem_id="vs-cam-record", scale=1)
        cam_rec_btn = gr.Button("Download recording (MP4; ends a recording still running)",
                                elem_id="vs-cam-recording", scale=1)
        cam_rec_file = gr.File(label="Recording of your camera", elem_id="vs-cam-recording-file", scale=2,
                               elem_classes="vs-download")
    cam_rec_btn.click(events.download(service.recording, "push"), None, cam_rec_file, api_name=False,
                      concurrency_limit=None)
    gr.Markdown(SHOTS_LABEL)
    cam_shots = gr.HTML(shots_html([]), elem_id="vs-cam-shots-box")
    _download_row(SHOTS_BUTTON, SHOTS_FILE_LABEL, "vs-cam-shots-zip", events.download(service.export_shots, "push"),
                  False)
    cam_shown = gr.State(None)  # the newest change picture the page shows (page_values.new_shots)
    cam.stream(events.webcam, [cam, *form, cam_record, cam_shown], [cam_frame, cam_counters, cam_shots, cam_shown],
               stream_every=0.1, concurrency_limit=None, show_progress="hidden", api_name=False)
    cam_silence = gr.State(None)
    gr.Timer(1.0).tick(events.cam_silent, cam_silence, [cam_counters, cam_silence], api_name=False,
                       concurrency_limit=None, show_progress="hidden")


def video_tab(events: PageEvents) -> None:
    """The Video file tab: a whole file captioned as `vlmstream video` does, with its downloads."""
    with gr.Row():
        vfile = gr.File(label="Video", file_types=video_file_types(), type="filepath", elem_id="vs-video-file")
        with gr.Column():
            form = _prompt_form(PLACE_PROMPTS, OBJECT_QUESTION_LABEL, "vs-video")
            # step, not precision=0: that rounded 1.5 to 2 before the job's check could say it is no whole number
            every = gr.Number(1, step=1, label="Every n-th frame")  # checked by the job: one line, no trace
            vchanges = gr.Checkbox(False, label="Only the answers that change (a table of events; the "
                                                "JSONL too)", elem_id="vs-video-changes")
            with gr.Row():
                vrun = gr.Button("Caption video", variant="primary", elem_id="vs-video-run")
                vcancel = gr.Button("Cancel", elem_id="vs-video-cancel")
    vnote = gr.Markdown(elem_id="vs-video-note")
    # Shares of the table's width: sized by their content, the captions' column alone was wider
    # than a phone (390 px), cut mid-word at the window's edge and the ms column out of sight
    vtable = gr.Dataframe(headers=["frame", "time (s)", "caption", "ms"], wrap=True,
                          column_widths=["15%", "15%", "55%", "15%"], elem_id="vs-video-table")
    vfiles = gr.File(label="Downloads (SRT, VTT, JSONL, annotated MP4; detect and point: JSONL, MP4)",
                     file_count="multiple")
    vvideo = gr.Video(label="Annotated video")
    # The previous job's results go when a new one starts: a job that then failed left them
    # under its error, "90 frames captioned" beside the new file's "empty (0 bytes)".
    vrun.click(lambda: ("", None, None, None), None, [vnote, vtable, vfiles, vvideo], queue=False,
               api_name=False, show_progress="hidden")
    # not Gradio's concurrency limit: a job waiting for a slot must already answer Cancel
    # (VideoJobs.wait_turn)
    kind, question, ckind, ctext = form
    vrun.click(events.video, [vfile, kind, question, every, ckind, ctext, vchanges], [vnote, vtable, vfiles, vvideo],
               api_name="caption_video", concurrency_limit=None)
    # also an API: a gradio_client's job.cancel() cannot stop a running job (Gradio ends the
    # event, not the work); /cancel_video from the same Client does
    vcancel.click(events.cancel_video, None, None, api_name="cancel_video", concurrency_limit=None)


def image_tab(events: PageEvents) -> None:
    """The Image tab: one picture captioned or asked about; detect and point with Moondream 2."""
    with gr.Row():
        # As uploaded, read as `vlmstream image` reads a file (Gradio's RGB conversion
        # showed what lies under transparent pixels; a palette came as its indices)
        img = gr.Image(type="pil", image_mode=None, label="Image")
        img.preprocess = _read_in_one_line(img.preprocess)
        with gr.Column():
            form = _prompt_form(PROMPTS, QUESTION_LABEL, value="normal")
            irun = gr.Button("Caption", variant="primary")
            with gr.Row():  # the region head: Moondream 2 weights (the tiny model's is untrained)
                iobject = gr.Textbox(label="Object to detect or point at (Moondream 2 weights)", scale=2)
                idetect = gr.Button("Detect", elem_id="vs-image-detect")
                ipoint = gr.Button("Point", elem_id="vs-image-point")
    itext = gr.Textbox(label="Answer", elem_id="vs-image-text")
    iplaces = gr.Image(label="Places", visible=False, interactive=False, format="png",
                       elem_id="vs-image-places")  # crisp lines
    itimings = gr.JSON(label="Result and timings")
    # The places drawn belong to the Detect or Point that drew them: they had stayed beside a later
    # caption, and beside a new image, as if found on it.
    for stale in (irun.click, img.change):
        stale(lambda: gr.Image(None, visible=False), None, iplaces, queue=False, api_name=False, show_progress="hidden")
    irun.click(events.image, [img, *form], [itext, itimings], api_name="caption_image", concurrency_limit=None)
    for button, task in ((idetect, "detect"), (ipoint, "point")):
        button.click(events.locator(task), [img, iobject],
                     [itext, iplaces, itimings], api_name=f"{task}_image", concurrency_limit=None)


def settings_tab(events: PageEvents) -> list:
    """The Settings tab: the model, device and decoding every tab shares (one engine). Returns its
    form's fields and the state of what they show (`SettingsEvents.form` fills them)."""
    s = events.service.settings
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
                           "frames in a row (1 = every change)")
    if events.settings.settings_by is not None:  # the others see who may, before they try
        gr.Markdown(f"Applied by {', '.join(sorted(events.settings.settings_by))} only (this server's --settings-by).")
    sapply = gr.Button("Apply", variant="primary")
    sstatus = gr.Markdown(elem_id="vs-settings-status")  # said to a screen reader (page_head.HEAD_JS)
    stats = gr.JSON(label="Engine")
    form = [model, device, temperature, max_tokens, pipelined, sticky, hold]
    shown = gr.State(None)  # the form as the page last showed it (PageEvents.apply)
    # The last Apply's "settings applied" goes when Apply is pressed again: it had stayed beside a
    # refused value's error, as if that value were applied.
    sapply.click(lambda: "", None, sstatus, queue=False, api_name=False, show_progress="hidden")
    # Once applied, the form shows what now runs: a box left empty (or a number the browser could
    # not read, such as 1e400) keeps its setting, and had stayed empty beside "settings applied".
    sapply.click(events.settings.apply, [*form, shown], sstatus, api_name="apply_settings").success(
        events.settings.form, None, [*form, shown], api_name=False, show_progress="hidden", queue=False)
    gr.Timer(1.0).tick(events.service.engine_stats, None, stats, api_name="engine_stats", show_progress="hidden")
    return [*form, shown]


def _read_in_one_line(preprocess: Callable) -> Callable:
    """An Image component's preprocess, whose upload Pillow cannot read (not an image, a
    decompression bomb, a file cut short) is said in one line with the file's name, as `vlmstream
    image` says it: Gradio's own error was a paragraph of its internals naming its scratch path,
    with a traceback in the server's console, or for a truncated file its bare "image file is
    truncated". (A subclass of gr.Image would do it too, but Gradio writes a .pyi file beside its
    module.)"""
    import warnings

    from PIL import Image

    from engine.errors import ImageError
    from pipelines.image_file import read_image

    # An image past Pillow's warning size (89 Mpx; twice that is refused) is read as `vlmstream
    # image` reads it, without Pillow's DecompressionBombWarning: Gradio's decoding printed it, two
    # lines of Pillow's source, in the server's console for each such upload. Once for the process
    # (warnings.catch_warnings around each read is not thread-safe: pages upload side by side).
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

    def read(payload):
        try:
            return preprocess(payload)
        except Exception as e:
            path = str(getattr(payload, "path", "") or "")
            try:
                if path:
                    read_image(path)  # why, in the words of the command line's reading (its decoding too)
            except ImageError as why:
                raise user_error(str(upload_named(why, path)).splitlines()[0]) from None
            raise user_error(str(upload_named(e, path)).splitlines()[0] or type(e).__name__) from None

    return read
