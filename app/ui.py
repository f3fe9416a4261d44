"""`vlmstream ui`: the Gradio web UI (live view, browser webcam, video files, single images, settings).

One `Service` (one engine) per process, shared by every browser tab; each tab's live feeds are
keyed by its Gradio session and closed when the tab goes away. Each tab's layout is in `app.tabs`,
what its events do in `app.page_events`. No engine logic here: events call `app.service`, which
calls the pipelines' public functions. Importing this module is cheap: Gradio and the engine load
when `build` or `run` is called.
"""

import argparse
import os
import re
import sys
import time
from typing import Callable

from app.samples import sample_videos
from app.service import Service
from app.settings import Settings

DEFAULT_SAMPLE = "shapes_640x360_60fps.mp4"


def build(service: Service, source: str | None = None, settings_by: frozenset[str] | None = None):
    """settings_by: the users (of the server's auth) who may apply Settings; None: everyone."""
    import gradio as gr

    from app import tabs
    from app.page_events import PageEvents

    events = PageEvents(service, settings_by)
    samples = sample_videos()
    default_source = source or (DEFAULT_SAMPLE if DEFAULT_SAMPLE in samples else (samples[0] if samples else ""))
    # Gradio keeps its own copies of uploads and results; hourly, those older than a day go, and all
    # of them when the server stops (a long-running server must not fill the disk).
    with gr.Blocks(title="vlmstream", analytics_enabled=False, delete_cache=(3600, 86400)) as demo:
        events.demo = demo
        gr.Markdown("# vlmstream\nReal-time video understanding: every frame captioned by a vision-language model.")
        with gr.Row():  # clicked by the page itself when it is hidden or shown (HEAD_JS; CSS hides them)
            page_hidden = gr.Button("pause", elem_id="vs-page-hidden")
            page_shown = gr.Button("resume", elem_id="vs-page-shown")
        with gr.Tab("Live", elem_id="vs-tab-live"):
            live_inputs, live_outputs = tabs.live_tab(events, samples, default_source)
        with gr.Tab("Browser webcam", elem_id="vs-tab-webcam"):
            tabs.webcam_tab(events)
        with gr.Tab("Video file", elem_id="vs-tab-video"):
            tabs.video_tab(events)
        with gr.Tab("Image", elem_id="vs-tab-image"):
            tabs.image_tab(events)
        with gr.Tab("Settings", elem_id="vs-tab-settings") as settings_page:
            settings = tabs.settings_tab(events)
        # The settings are the server's, shared by every page: a page shows them as they are when
        # it opens and when its Settings tab is chosen (another page may have applied new ones).
        for shown in (demo.load, settings_page.select):
            shown(events.settings.form, None, settings, api_name=False, show_progress="hidden", queue=False)
        # The page says where it is (HEAD_JS: after tab switches and visibility changes settle):
        # tabs' own select events, run side by side, left a quick Video file -> Live stopped.
        page_hidden.click(events.leave_live, None, None, api_name=False, concurrency_limit=None,
                          show_progress="hidden", trigger_mode="multiple")
        page_shown.click(events.back_to_live, live_inputs, live_outputs, api_name=False, concurrency_limit=None,
                         show_progress="hidden", trigger_mode="multiple")
        demo.unload(events.closed)
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

    from app.page_values import user_error

    def read(payload):
        try:
            return preprocess(payload)
        except gr.Error as e:
            raise user_error(f"{label}: {str(e.message).splitlines()[0]}") from None
        except (TypeError, ValueError) as e:
            raise user_error(f"{label}: {payload!r:.40} is not a valid value ({type(e).__name__})") from None

    return read


def check_listed(named: dict[str, str], samples: list[str]) -> None:
    """The --sources checked before the model loads, as --source is: a list's mistake (a mistyped
    URL scheme, a missing file) had been found by each page's Start, in a one-line error that
    named only the source; a name that is a sample's had hidden the sample (the page's list showed
    it twice, and both played the camera). A webcam is not opened (it may be plugged in later)."""
    from app.cli import UsageError
    from pipelines.pipe import is_named_pipe
    from pipelines.sources import SourceError
    from pipelines.webcam import parse_webcam

    from app.source_list import open_listed

    for name, source in named.items():  # read once, where every page's Start opens it again
        if name in samples:
            raise UsageError(f"--sources: {name} is the name of a sample video: name the source otherwise")
        if source == "-" or is_named_pipe(source):
            raise UsageError(f"--sources: {name} = {source}: the web UI does not read standard input or a named "
                             "pipe (`vlmstream live` does)")
        try:
            if parse_webcam(source) is None and source not in samples:  # a page's Start plays a sample's name
                open_listed(source, name)  # a stream is not connected to: its URL is checked
        except SourceError as e:
            raise UsageError(f"--sources: {e}") from None


def run(args: argparse.Namespace) -> int:
    from app.cli import UsageError, reading_arg, realtime_dtype
    from app.listen import check_port, loopback, read_auth, settings_users, tls_arguments
    from app.source_list import read_sources
    from app.page_head import CSS, HEAD_JS
    from pipelines.pipe import is_named_pipe

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
    settings_by = settings_users(args.settings_by, auth)
    sources = read_sources(args.sources, args.listed_only, sample_videos())
    check_listed(sources.named, sample_videos())
    if auth is None and not loopback(args.host):
        reach = "" if sources.only else ", and its page plays any file or URL this server reaches"
        print(f"vlmstream: warning: the UI on {args.host} asks no password{reach} (--auth-file)", file=sys.stderr)
    if args.source and args.source not in sample_videos() and args.source not in sources.named:
        from pipelines.sources import open_live

        if sources.only:
            raise UsageError(f"--source {args.source} is none of the --sources (--listed-only): name one of them")
        open_live(args.source)  # a missing file or camera, a bad URL scheme: SourceError, exit 2
    dtype = realtime_dtype(args.device, args.dtype)
    service = Service(Settings(model=args.model, device=args.device, dtype=dtype), reading_arg(args), args.max_feeds,
                      sources)
    # Gradio's copies of uploads and results in this server's own folder, removed with it when the
    # server stops (in /tmp/gradio they stayed: exports, recordings, every video job's files).
    # Unset again at the end: a second server in this process (tests) must not inherit a removed folder.
    own_temp = "GRADIO_TEMP_DIR" not in os.environ
    if own_temp:
        os.environ["GRADIO_TEMP_DIR"] = str(service.jobs.scratch() / "gradio")
    demo = None
    from app import activity

    log_handler = activity.to_stderr()  # who started what, and why it stopped: a line each
    try:
        service.engine()  # a bad --model fails here, in one line, before the server starts
        demo = build(service, args.source, settings_by)
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
                service.close("the server stopped")
            finally:
                service.remove_outputs()
                activity.log.removeHandler(log_handler)
                activity.log.propagate = True
                if own_temp:
                    os.environ.pop("GRADIO_TEMP_DIR", None)
    return 0
