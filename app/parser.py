"""`vlmstream`'s argument parser: every command with its flags and their help (what `--help`
prints). Each command's `func` runs it from its own module, imported only when that command runs.
argparse's own mistakes are one line and exit code 2, as every other user mistake (`app.cli`).
The flag groups several commands share (model, sticky, --changes, reading) are in app/flags.py.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn

from app.flags import (NATIVE_BF16, Once, add_changes_args, add_model_args, add_reading_args, add_sticky_arg,
                       add_vision_thread_arg, lazy)
from app.inflight_share import MAX_FEEDS
from app.prompt_args import add_constraint_args, add_prompt_args

EXIT_USAGE = 2
# Answer options whose parser default is None (see prompt_args.region_task): their defaults
MAX_TOKENS_FRAMES, MAX_TOKENS_IMAGE, TOP_P = 64, 768, 0.3
# Frames `video --detect` locates together: 4 images in step make ~1.6x the frames a second of one
# on the tiny layout, 8 ~1.8x (BENCHMARKS.md); each holds a KV buffer of the whole context.
LOCATE_BATCH = 4


class _Parser(argparse.ArgumentParser):
    """argparse's own mistakes (a bad number, an unknown option, two flags that exclude each
    other) in one line like every other: its usage block came first, up to a dozen lines that
    hid the error, under the prefix `vlmstream image: error:`."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        help_cmd = f"vlmstream {command} --help" if command else "vlmstream --help"
        self.exit(EXIT_USAGE, f"vlmstream: error: {message} (see {help_cmd})\n")


_SIZE_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def upload_size(text: str) -> int:
    """Bytes of a size such as "500mb" or "4 GB" (units of 1024, as Gradio counts them)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?b)\s*", text.lower())
    if not m or int(m[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: write a whole number and a unit, e.g. 500mb or 4gb")
    return int(m[1]) * _SIZE_UNITS[m[2]]


class _NoJson(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("video has no --json: its answers are JSON lines with -o OUT.jsonl, or -o - on standard output")


def _feeds_limit(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: write a whole number of feeds >= 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    """Every command with its flags; each command's `func` runs it."""
    from importlib.metadata import PackageNotFoundError, version

    p = _Parser(prog="vlmstream", description="Real-time video understanding with a VLM.")
    try:
        p.add_argument("--version", action="version", version=f"vlmstream {version('vlmstream')}")
    except PackageNotFoundError:  # run from a source tree that was never installed
        pass
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _image_command(sub)
    _video_command(sub)
    _live_command(sub)
    _ui_command(sub)
    _bench_command(sub)
    _train_command(sub)
    _eval_command(sub)
    return p


def _image_command(sub) -> None:
    img = sub.add_parser("image", help="caption or ask a question about images",
                         description="Caption images or answer a question about them (one image: the reference "
                                     "decoder, word by word; several: the engine, answers in order).")
    img.add_argument("image", nargs="+", metavar="IMAGE|FOLDER",
                     help="image files (any format Pillow reads; an http(s) URL names one on a web server; - "
                          "the one piped into standard input), or "
                          "folders: every image under them; one image "
                          "prints its answer as it comes, several a line each (\"IMAGE: answer\")")
    add_model_args(img, "float32 on cpu for a folder not stored in bf16 (the tiny model, train-tiny's), "
                        "else " + NATIVE_BF16)
    task = img.add_mutually_exclusive_group()
    task.add_argument("--caption", choices=["short", "normal", "long"], action=Once,
                      help="caption length (default: normal, unless --question is given)")
    task.add_argument("--question", metavar="TEXT", action=Once, help="a question about the image")
    task.add_argument("--detect", metavar="OBJECT", action=Once,
                      help="boxes around every OBJECT (Moondream 2 weights: the tiny model's region head is untrained)")
    task.add_argument("--point", metavar="OBJECT", action=Once, help="the centre of every OBJECT (as --detect)")
    add_constraint_args(img)
    _add_sampling_args(img)
    img.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, finish_reason, timings_ms, asked (for a "
                          "question: what the model was asked, {\"question\": ...} or {\"caption\": length}), "
                          "model, device, dtype, seed, load_ms, read_ms; with --detect (--point): detect (point), "
                          "objects (points) as fractions, pixels, width, height, batch "
                          "(several images: one a line, with an 'image' field)")
    img.set_defaults(func=lazy("app.image"))


def _video_command(sub) -> None:
    vid = sub.add_parser("video", help="caption video files (or folders of them) frame by frame",
                         description="Caption (or ask about) the frames of video files; results in frame order.")
    vid.add_argument("files", nargs="+", metavar="FILE|FOLDER",
                     help="video files (whatever FFmpeg reads; an http(s) URL names one on a web server), or "
                          "folders: every video in them and their subfolders, by extension (unreadable ones "
                          "there are skipped with a warning)")
    add_prompt_args(vid)
    # `image --json` and `live --json` exist, so users type `video --json`: argparse took it for an
    # abbreviation of --json-schema ("expected one argument")
    vid.add_argument("--json", action=_NoJson, nargs=0, help=argparse.SUPPRESS)
    region = vid.add_mutually_exclusive_group()
    region.add_argument("--detect", metavar="OBJECT", action=Once,
                        help="boxes around every OBJECT in each processed frame, as JSON lines (or terminal lines), "
                             "the number found in subtitles, drawn by --annotate (Moondream 2 weights: the tiny "
                             "model's region head is untrained)")
    region.add_argument("--point", metavar="OBJECT", action=Once, help="the centre of every OBJECT (as --detect)")
    vid.add_argument("--batch", type=int, default=None, metavar="N",
                     help=f"with --detect/--point: frames located together, one forward a step for all (default "
                          f"{LOCATE_BATCH}; each holds a KV buffer of the model's context: ~0.8 GB for Moondream 2 "
                          "in fp32)")
    pick = vid.add_mutually_exclusive_group()
    pick.add_argument("--fps", type=float, metavar="N", help="process N frames per second of video")
    pick.add_argument("--every-n", type=int, metavar="N", help="process every Nth frame")
    pick.add_argument("--every-frame", action="store_true", help="process every frame (the default)")
    vid.add_argument("-o", "--output", metavar="OUT",
                     help="write OUT.jsonl, OUT.srt or OUT.vtt (by extension), or JSON lines to standard "
                          "output (-); or a FOLDER/: one output per video, named after it (subfolders kept), "
                          "in each of --format's formats")
    vid.add_argument("--format", metavar="LIST",
                     help="with -o FOLDER/: jsonl, srt, vtt, or several separated by commas (default jsonl)")
    vid.add_argument("--annotate", metavar="OUT.mp4",
                     help="write an MP4 with captions and latency drawn; a FOLDER/: one per video")
    add_changes_args(vid, "JSON lines (or terminal lines) only for answers that differ from the last one of "
                          "their video and prompt, with the answer replaced (previous) and when it began (since); with "
                          "--detect/--point, when the number found changes",
                      "processed frames", "JSON line")
    add_sticky_arg(vid, "the answer of the frames a quarter second earlier")
    vid.add_argument("--resume", action="store_true",
                     help="skip frames already in the JSONL output (other outputs are rebuilt from it); "
                          "without it, outputs are written afresh")
    add_model_args(vid, NATIVE_BF16)
    vid.add_argument("--max-tokens", type=int, default=None, metavar="N",
                     help=f"answer length limit (default {MAX_TOKENS_FRAMES})")
    add_vision_thread_arg(vid, "frames", "same answers, for comparison")
    add_reading_args(vid)
    vid.set_defaults(func=lazy('app.video'))


def _live_command(sub) -> None:
    live = sub.add_parser("live", help="caption a live source frame by frame (latest frame wins)",
                          description="Caption a live source: a network stream (reconnecting when it breaks) "
                                      "or a file played in real time (looped to --duration); several sources "
                                      "share one engine, each with its own latest-frame-wins session.")
    live.add_argument("sources", nargs="*", metavar="SOURCE",
                      help="a video file (played in real time), webcam:N (or /dev/videoN), a stream URL: "
                           "rtsp, udp, http(s)/HLS, rtmp, or - for a stream piped in (rpicam-vid -t 0 -o - | "
                           "vlmstream live -); several sources share one engine; with --sources, a NAME of its file")
    live.add_argument("--sources", dest="source_file", metavar="FILE",
                      help="named sources, one 'NAME = SOURCE' a line (as `ui --sources`): all of them, or those "
                           "named as SOURCE; each goes by its name in what the run says and writes, so a camera's "
                           "password is in no command line (ps, shell history) and no output")
    add_prompt_args(live, " (a frame completes with all its answers)")
    region = live.add_mutually_exclusive_group()
    region.add_argument("--detect", metavar="OBJECT", action=Once,
                        help="boxes around every OBJECT in each newest frame, at the region decoder's pace "
                             "(frames that come while it works are passed over), drawn by --annotate "
                             "(Moondream 2 weights: the tiny model's region head is untrained)")
    region.add_argument("--point", metavar="OBJECT", action=Once, help="the centre of every OBJECT (as --detect)")
    live.add_argument("--fps", type=float, default=60.0, help="highest intake rate (default 60)")
    live.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    live.add_argument("--max-outage", type=float, default=None, metavar="S",
                      help="give up on a stream that sends nothing for S seconds once it has sent frames, a hung "
                           "camera too: within a second of S, each try to reconnect cut to the time left "
                           "(default: reconnect for as long as it takes, as for a camera that reboots; a stream "
                           "that never sent a frame is given 30 s)")
    live.add_argument("--max-inflight", type=int, default=None, metavar="N",
                      help="frames of a source in the engine at once (default 4, shared out among several "
                           "sources: as many frames a second as more would give on 2 cores, with less latency; "
                           "one while answers take over a second)")
    live.add_argument("--deadline-ms", type=float, default=None, metavar="D", help="cancel a frame after D ms")
    live.add_argument("--max-tokens", type=int, default=None, metavar="N",
                      help=f"answer length limit (default {MAX_TOKENS_FRAMES}: the tiny model's long captions take up "
                           "to 44)")
    add_sticky_arg(live, "the previous frame's answer")
    live.add_argument("--no-draft", action="store_true",
                      help="decode every frame's answer token by token, without the previous answer as a draft "
                           "(same answers, for comparison)")
    add_vision_thread_arg(live, "frames", "same answers, for comparison")
    add_model_args(live, NATIVE_BF16)
    live.add_argument("--json", action="store_true", help="print one final JSON object with the session's figures")
    add_changes_args(live, "print (and log) an answer only when it changes, with the answer it replaced: "
                           "events instead of every frame (--detect/--point: when the number found changes)", "frames", "log")
    live.add_argument("--annotate", metavar="OUT.mp4",
                      help="record the completed frames with their answers and latency drawn, at the times they "
                           "were captured, and a stream's outages over the gap (its last picture darkened, when and "
                           "how long in a red band); a FOLDER/: one file per source, named by start time and source")
    live.add_argument("-o", "--output", metavar="OUT.jsonl",
                      help="append one JSON line per captioned frame (source, index, pts, UTC time, text, "
                           "token ids, timings), and an \"event\": \"outage\" line when a stream is lost, back "
                           "(start, end, duration_s) or given up; '-' writes them to standard output instead of "
                           "the captions")
    add_reading_args(live)
    live.set_defaults(func=lazy('app.live'))


def _ui_command(sub) -> None:
    ui = sub.add_parser("ui", help="the web UI: live view, browser webcam, video files (Gradio)",
                        description="Serve the web UI; it opens with a sample video playing live.")
    ui.add_argument("--source", default=None, metavar="SOURCE",
                    help="what the Live tab plays when a page opens: a sample name, a file, webcam:N or a "
                         "URL (default: the 60 fps sample)")
    add_reading_args(ui)
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    ui.add_argument("--ssl-certfile", metavar="FILE",
                    help="serve HTTPS with this certificate (PEM), with --ssl-keyfile: a browser lets a page "
                         "use its camera (the Browser webcam tab) only over HTTPS, or from this machine")
    ui.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM, unencrypted)")
    ui.add_argument("--max-upload", type=upload_size, default=upload_size("4gb"), metavar="SIZE",
                    help="largest file a page may upload, e.g. 500mb or 8gb (default 4gb): a bigger one is "
                         "refused before it fills this server's disk")
    ui.add_argument("--max-feeds", type=_feeds_limit, default=MAX_FEEDS, metavar="N",
                    help=f"live feeds played at once, pages' and API clients' together (a browser camera "
                         f"that stopped sending not counted); a Start beyond them is refused (default {MAX_FEEDS})")
    ui.add_argument("--auth-file", metavar="FILE",
                    help="ask for a user name and password: FILE has one 'user:password' a line (the page can "
                         "play any file or URL the server reaches, so share it on a network only with this)")
    ui.add_argument("--sources", metavar="FILE",
                    help="named sources for the Live tab, one 'NAME = SOURCE' a line (a stream URL, webcam:N or "
                         "a file): pages choose them by name and never see the URL or its password")
    ui.add_argument("--listed-only", action="store_true",
                    help="the Live tab plays only the --sources, the samples and uploaded files: no path, URL "
                         "or webcam of this server typed in")
    ui.add_argument("--settings-by", metavar="USER[,USER]",
                    help="only these users of the --auth-file may apply Settings (a new model stops every "
                         "viewer's feeds and jobs); default: every user")
    add_model_args(ui, NATIVE_BF16)
    ui.set_defaults(func=lazy('app.ui'))


def _bench_command(sub) -> None:
    bench = sub.add_parser("bench", help="decode throughput: pipelined vs blocking",
                           description="Throughput of pipelined vs blocking decoding at several concurrencies.")
    add_model_args(bench, random=True)
    bench.add_argument("--streams", default="1,8,32", metavar="N,N,...",
                       help="concurrent requests per run, each 1 to 1024 (default 1,8,32)")
    bench.add_argument("--tokens", type=int, default=64, metavar="N",
                       help="answer tokens per request, at least 2 (default 64)")
    bench.add_argument("--repeats", type=int, default=3, metavar="N",
                       help="runs per mode, at least, and on until each mode has run --seconds; medians (default 3)")
    bench.add_argument("--seconds", type=float, default=3.0, metavar="S",
                       help="wall time each mode runs at least, per concurrency: longer evens out a noisy "
                            "machine (default 3; 0: just --repeats)")
    bench.add_argument("--frames", type=int, default=240, metavar="N",
                       help="also caption N distinct 640x360 frames and report frames/s (0 skips; default 240)")
    bench.add_argument("--no-script", action="store_true",
                       help="CPU: decode eagerly instead of through TorchScript (for comparison)")
    add_vision_thread_arg(bench, "images", "for comparison")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bench.set_defaults(func=lazy("app.bench"))


def _train_command(sub) -> None:
    tr = sub.add_parser("train-tiny", help="train the embedded tiny model on generated scenes (CPU)",
                        description="Train the tiny model on the procedural scene world; deterministic for a seed "
                                    "when the run keeps ahead of its time budget's pace (the steps, not the clock, "
                                    "drive its schedule).")
    tr.add_argument("--out", default=None, metavar="DIR", help="output folder (default: the embedded tiny folder)")
    tr.add_argument("--steps", type=int, default=30000,
                    help="optimizer steps (default 30000; the time budget ends the run first, and with it "
                         "the vision-only stage lasts ~18 of the 85 minutes)")
    tr.add_argument("--batch-size", type=int, default=16, help="images per step (default 16)")
    tr.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    tr.add_argument("--seed", type=int, default=0,
                    help="the initial weights (default 0; the scenes are set by --first-item)")
    tr.add_argument("--threads", type=int, default=1,
                    help="torch threads for training (default 1: the scene renderer has the other core)")
    tr.add_argument("--max-minutes", type=float, default=85.0, help="stop early after this long (default 85)")
    tr.add_argument("--processes", type=int, default=2,
                    help="training processes averaging gradients, each with its own scene renderer (default 2)")
    tr.add_argument("--vision-share", type=float, default=0.25,
                    help="share of the run that trains the vision encoder alone on its dense targets (default 0.25)")
    tr.add_argument("--init", default=None, metavar="DIR",
                    help="continue from this weights folder (tiny: the embedded one; same architecture and "
                         "tokenizer) instead of random weights, e.g. with --vision-share 0 and a lower --lr")
    tr.add_argument("--first-item", type=int, default=0,
                    help="index of the first training scene (default 0; a continued run takes scenes the first "
                         "never saw)")
    tr.add_argument("--tiling", default=None, choices=["fill", "moondream"],
                    help="the vision tiling trained on (default: fill, the tiny model's)")
    tr.add_argument("--regions", type=int, default=0, metavar="N",
                    help="detect and point tasks per training image (0..8, default 0): trains the region head")
    tr.add_argument("--freeze-vision", action="store_true",
                    help="train the decoder and region head alone, the vision encoder as in --init "
                         "(with --vision-share 0)")
    tr.set_defaults(func=lazy("app.train_tiny"))


def _eval_command(sub) -> None:
    ev = sub.add_parser("eval-tiny", help="accuracy on held-out generated scenes",
                        description="Caption and question accuracy on scenes from a seed range never used in training.")
    add_model_args(ev)
    ev.add_argument("--n", type=int, default=1000, help="held-out scenes (default 1000)")
    ev.add_argument("--renderer", default="world", choices=["world", "second"],
                    help="draw the scenes with the world's renderer (training's; the default) or a second, "
                         "independent one")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ev.set_defaults(func=lazy("app.eval_tiny"))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0 = greedy (default); > 0 samples with top-p")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help=f"nucleus mass, in (0, 1] (default {TOP_P})")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help=f"answer length limit (default {MAX_TOKENS_IMAGE})")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed (default: a fresh one, reported with --json)")
