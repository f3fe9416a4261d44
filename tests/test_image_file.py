import numpy as np
import pytest
from PIL import Image

from engine.errors import ImageError
from pipelines.image_file import check_image, read_image

RGB = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [255, 255, 255]]], dtype=np.uint8)


def test_rgb_png(tmp_path):
    Image.fromarray(RGB).save(tmp_path / "a.png")
    out = read_image(tmp_path / "a.png")
    assert out.dtype == np.uint8 and out.shape == (2, 2, 3)
    assert np.array_equal(out, RGB)


def test_grayscale(tmp_path):
    Image.fromarray(np.array([[0, 128], [200, 255]], dtype=np.uint8), "L").save(tmp_path / "g.png")
    out = read_image(tmp_path / "g.png")
    assert out.shape == (2, 2, 3)
    assert out[1, 0].tolist() == [200, 200, 200]


def test_transparency_in_rarer_modes(tmp_path):
    """A 16-bit grey PNG's transparent level (tRNS) showed black; premultiplied grey + alpha ("La")
    was a ValueError from Pillow, not an ImageError."""
    from engine.request import as_rgb

    wide = np.array([[0, 65535], [1000, 1000]], dtype=np.uint16)
    Image.fromarray(wide).save(tmp_path / "w.png", transparency=1000)
    assert read_image(tmp_path / "w.png")[:, :, 0].tolist() == [[0, 255], [128, 128]]
    la = Image.fromarray(np.dstack([np.full((2, 2), 200, np.uint8), np.array([[0, 255], [128, 255]], np.uint8)]), "LA")
    assert as_rgb(la.convert("La"))[:, :, 0].tolist() == [[128, 200], [164, 200]]


def test_rgba_shows_what_is_transparent_as_mid_grey(tmp_path):
    rgba = np.dstack([RGB, np.array([[0, 255], [128, 255]], dtype=np.uint8)])
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    a = rgba[:, :, 3:].astype(int)
    want = (RGB.astype(int) * a + 128 * (255 - a) + 127) // 255
    assert np.array_equal(read_image(tmp_path / "a.png"), want)
    assert (read_image(tmp_path / "a.png")[0, 0] == 128).all()  # fully transparent
    Image.fromarray(rgba, "RGBA").convert("LA").save(tmp_path / "la.png")
    assert (read_image(tmp_path / "la.png")[0, 0] == 128).all() and read_image(tmp_path / "la.png").shape == (2, 2, 3)


@pytest.mark.parametrize("transparent", [False, True])
def test_palette(tmp_path, transparent):
    img = Image.fromarray(RGB).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    if transparent:
        img.info["transparency"] = 0
    img.save(tmp_path / "p.png", **({"transparency": 0} if transparent else {}))
    want = RGB.copy()
    if transparent:  # the colour at index 0 is see-through: mid grey shows there
        want[np.asarray(Image.open(tmp_path / "p.png")) == 0] = 128
    assert np.array_equal(read_image(tmp_path / "p.png"), want)


def test_16bit_grayscale_is_scaled(tmp_path):
    wide = np.array([[0, 65535], [32768, 257 * 100]], dtype=np.uint16)
    Image.fromarray(wide).save(tmp_path / "w.png")
    assert Image.open(tmp_path / "w.png").mode.startswith("I")
    out = read_image(tmp_path / "w.png")
    assert out[:, :, 0].tolist() == [[0, 255], [128, 100]]


def test_16bit_rgb_png(tmp_path):
    # 48-bit RGB PNG, written by hand: Pillow cannot write it, but users have such files.
    import struct
    import zlib

    h, w = 2, 2
    pix = (RGB.astype(np.uint16) * 257).astype(">u2")
    raw = b"".join(b"\x00" + pix[y].tobytes() for y in range(h))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    (tmp_path / "rgb48.png").write_bytes(png)
    assert np.array_equal(read_image(tmp_path / "rgb48.png"), RGB)


def test_cmyk_jpeg(tmp_path):
    Image.fromarray(RGB).convert("CMYK").save(tmp_path / "c.jpg")
    out = read_image(tmp_path / "c.jpg")
    assert out.shape == (2, 2, 3) and out.dtype == np.uint8


def test_exif_orientation_is_applied(tmp_path):
    img = Image.fromarray(np.zeros((2, 4, 3), dtype=np.uint8))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    img.save(tmp_path / "r.jpg", exif=exif)
    assert read_image(tmp_path / "r.jpg").shape == (4, 2, 3)


@pytest.mark.parametrize("make, needle", [
    (lambda p: None, "image not found"),
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: p.write_bytes(b""), "empty"),
    (lambda p: p.write_text("hello, I am text"), "not an image"),
    (lambda p: Image.new("L", (64, 64)).save(p), "too large to decode safely"),  # past MAX_IMAGE_PIXELS below
])
@pytest.mark.parametrize("read", [read_image, check_image])
def test_bad_files(tmp_path, monkeypatch, make, needle, read):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 64 x 64 is a decompression bomb then
    path = tmp_path / "x.png"
    make(path)
    with pytest.raises(ImageError, match=needle):
        read(path)


def test_truncated_image(tmp_path):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "t.png")
    data = (tmp_path / "t.png").read_bytes()
    (tmp_path / "t.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match="could not be decoded") as e:
        read_image(tmp_path / "t.png")
    assert "\n" not in str(e.value)


def test_a_damaged_avif_is_an_image_error(tmp_path):
    """Pillow's AVIF decoder raises RuntimeError, when opened or when decoded: a traceback that
    lost every other image's answer."""
    import io

    from PIL import features

    from engine.request import as_rgb

    if not features.check("avif"):
        pytest.skip("this Pillow reads no AVIF")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(buf, "AVIF")
    data, found = buf.getvalue(), {}
    for offset in range(0, len(data) - 4, 3):  # a damaged header (fails to open), damaged pixels (fail to load)
        damaged = data[:offset] + b"\xff" * 4 + data[offset + 4:]
        try:
            img = Image.open(io.BytesIO(damaged))
        except RuntimeError:
            found.setdefault("open", damaged)
            continue
        except Exception:
            continue
        try:
            img.load()
        except RuntimeError:
            found.setdefault("load", (damaged, img))
        except Exception:
            pass
    assert set(found) == {"open", "load"}
    (tmp_path / "h.avif").write_bytes(found["open"])
    (tmp_path / "p.avif").write_bytes(found["load"][0])
    with pytest.raises(ImageError, match="h.avif could not be read"):
        check_image(tmp_path / "h.avif")
    check_image(tmp_path / "p.avif")  # its header reads: it fails when decoded, as a cut file does
    with pytest.raises(ImageError, match="p.avif could not be decoded"):
        read_image(tmp_path / "p.avif")
    with pytest.raises(ImageError, match="the Pillow image could not be decoded"):  # the API, given Image.open's
        as_rgb(Image.open(io.BytesIO(found["load"][0])))


def test_a_float_image_with_a_highlight_past_one_is_not_black(tmp_path):
    """A 0..1 float image was scaled as 0..255 (black) when one pixel went past 1.0, or was inf."""
    f = np.full((10, 20), 0.25, np.float32)
    f[:, 10:] = 0.75
    for highlight in (1.05, np.inf):
        f[0, 0] = highlight
        Image.fromarray(f, "F").save(tmp_path / "f.tif")
        out = read_image(tmp_path / "f.tif")[:, :, 0]
        assert out[5, 2] == 64 and out[5, 15] == 191 and out[0, 0] == 255
    Image.fromarray(f * 200, "F").save(tmp_path / "g.tif")  # a 0..255 float image stays as it is
    assert read_image(tmp_path / "g.tif")[5, 2, 0] == 50
    line = np.zeros((200, 200), np.float32)  # a dark 0..255 one with a thin bright line (0.5 % of it)
    line[100, :] = 100.0
    Image.fromarray(line, "F").save(tmp_path / "l.tif")
    assert read_image(tmp_path / "l.tif")[100, 0, 0] == 100


def test_transparency_over_grey_is_the_same_by_bands(monkeypatch):
    """flatten_alpha works a band of rows at a time (a 13000 x 13000 PNG had taken 4.7 GB)."""
    from engine.request import flatten_alpha

    rgba = np.random.default_rng(1).integers(0, 256, (1501, 2000, 4), dtype=np.uint8)  # 699 rows a band
    a = rgba[:, :, 3:].astype(int)
    want = (rgba[:, :, :3].astype(int) * a + 128 * (255 - a) + 127) // 255
    assert np.array_equal(flatten_alpha(rgba), want)


def _png(rgb=RGB) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def _web(files: dict, auth: str | None = None, requests: list | None = None):
    """A web server on a free port answering `files` (path -> bytes), 404 otherwise; with `auth`,
    only to that Authorization header (401 otherwise, as a NAS does). Paths asked go to `requests`."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self):
            if requests is not None:
                requests.append(self.path)
            body = files.get(self.path)
            if auth is not None and self.headers.get("Authorization") != auth:
                self.send_response(401)
                body = b""
            else:
                self.send_response(404 if body is None else 200)
                body = body or b""
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_picture_behind_a_password_is_fetched_with_it_and_the_password_never_shown():
    """`image http://me:p%40ss@nas:8080/a.png`: the password (percent-escaped in the URL, as a
    password with @ or : must be) goes to the server as basic authentication, to the port named,
    and no message names it."""
    import base64

    auth = "Basic " + base64.b64encode(b"me:p@ss:w/rd").decode()
    server = _web({"/a.png": _png(), "/notes.png": b"hello, I am text"}, auth=auth)
    try:
        base = f"http://me:p%40ss%3Aw%2Frd@127.0.0.1:{server.server_address[1]}"
        assert np.array_equal(read_image(f"{base}/a.png"), RGB)
        with pytest.raises(ImageError) as e:
            check_image(f"{base}/notes.png")
        shown = f"http://***@127.0.0.1:{server.server_address[1]}/notes.png"
        assert str(e.value).startswith(f"{shown} is not an image") and "p%40ss" not in str(e.value)
        with pytest.raises(ImageError, match=r"\*\*\*@127.0.0.1:\d+/a.png: the server answered 401") as e:
            read_image(f"http://me:wrong@127.0.0.1:{server.server_address[1]}/a.png")
        assert "wrong" not in str(e.value)
    finally:
        server.shutdown()


def test_a_web_answer_too_large_or_empty_is_said(monkeypatch):
    """A URL that gives megabytes beyond the cap (a video, a dump) is refused rather than held in
    memory; an empty answer is said as empty, not as "not an image"."""
    import pipelines.image_file as image_file

    monkeypatch.setattr(image_file, "FETCH_MAX_BYTES", 1000)
    server = _web({"/big.png": b"\x89PNG" + bytes(4000), "/empty.png": b"", "/fits.png": _png()})
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ImageError, match=r"/big.png is larger than 0 MB: not an image to caption$"):
            read_image(f"{base}/big.png")
        with pytest.raises(ImageError, match=r"/empty.png is empty \(0 bytes\)$"):
            read_image(f"{base}/empty.png")
        assert np.array_equal(read_image(f"{base}/fits.png"), RGB)
    finally:
        server.shutdown()


def test_a_web_server_that_never_answers_is_given_up_after_the_fetch_timeout(monkeypatch):
    """A server that accepts the connection and never answers (a hung NAS) is an ImageError after
    FETCH_TIMEOUT_S, not a run that waits for ever."""
    import socket
    import threading
    import time

    import pipelines.image_file as image_file

    monkeypatch.setattr(image_file, "FETCH_TIMEOUT_S", 0.5)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # connections are taken into the backlog and never answered
        url = f"http://127.0.0.1:{server.getsockname()[1]}/a.png"
        said: list = []

        def read() -> None:
            try:
                read_image(url)
            except ImageError as e:
                said.append(str(e))

        t0 = time.monotonic()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "still waiting for a server that never answers"
    assert said == [f"cannot read {url}: timed out"] and time.monotonic() - t0 < 5


def test_images_checked_before_a_run_keep_a_bounded_number_of_bytes(monkeypatch):
    """check_image keeps what it fetched for read_image (one request per image), but at most
    FETCH_KEEP_BYTES, the oldest let go first: `image URL URL ...` of many large pictures held them
    all in memory otherwise. The last one checked is still read without a second request."""
    from collections import OrderedDict

    import pipelines.image_file as image_file

    files = {f"/{i}.png": _png(np.full((40, 40, 3), i * 40, np.uint8)) for i in range(5)}
    size = max(map(len, files.values()))
    monkeypatch.setattr(image_file, "FETCH_KEEP_BYTES", 2 * size)
    monkeypatch.setattr(image_file, "_kept", OrderedDict())
    requests: list = []
    server = _web(files, requests=requests)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        for name in files:
            check_image(base + name)
        assert sum(map(len, image_file._kept.values())) <= 2 * size
        assert read_image(f"{base}/4.png")[0, 0].tolist() == [160, 160, 160]
        assert requests.count("/4.png") == 1 and len(requests) == 5
        read_image(f"{base}/0.png")  # let go of: asked again
        assert requests.count("/0.png") == 2
    finally:
        server.shutdown()


def test_a_named_pipe_is_read_once_and_its_descriptor_closed(tmp_path):
    """`vlmstream image <(curl ...)` or a mkfifo a camera writes to: checked, then decoded from the
    bytes the check read (a pipe cannot be read twice), and the descriptor closed after."""
    import os
    import threading

    fifo = tmp_path / "shot.pipe"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as out:  # waits for the reader's open
            out.write(_png())

    fds = len(os.listdir("/proc/self/fd"))
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    check_image(fifo)
    assert np.array_equal(read_image(fifo), RGB)
    writer.join(10)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_named_pipe_nobody_writes_to_is_an_image_error_after_the_wait(tmp_path, monkeypatch):
    """A pipe whose writer never comes is one line after FETCH_TIMEOUT_S (not a TimeoutError
    traceback), and its descriptor is not left open."""
    import os

    import pipelines.image_file as image_file

    monkeypatch.setattr(image_file, "FETCH_TIMEOUT_S", 0.3)
    fifo = tmp_path / "shot.pipe"
    os.mkfifo(fifo)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ImageError, match=rf"^cannot read {fifo}: nothing came for 0.3 s$"):
        read_image(fifo)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_standard_input_at_a_terminal_or_too_large_is_said(monkeypatch):
    """`vlmstream image -` typed at a terminal says at once that nothing is piped in (it would wait
    for the keyboard); a pipe that goes on past the size cap is refused, not held in memory."""
    import io
    import os
    import sys

    import pipelines.image_file as image_file

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    with pytest.raises(ImageError, match=r"^nothing is piped into standard input \(-\)"):
        read_image("-")
    monkeypatch.setattr(image_file, "FETCH_MAX_BYTES", 1000)
    r, w = os.pipe()
    os.write(w, b"\x89PNG" + bytes(4000))
    os.close(w)
    with open(r, "rb") as piped:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(piped))
        with pytest.raises(ImageError, match=r"^standard input is over 0 MB: not an image to caption$"):
            read_image("-")
    r, w = os.pipe()
    os.write(w, b"hello, I am text")
    os.close(w)
    with open(r, "rb") as piped:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(piped))
        with pytest.raises(ImageError, match=r"^standard input is not an image"):
            read_image("-")


def test_an_ipv6_host_keeps_its_brackets_when_the_credentials_are_taken_out():
    """http://user:pass@[::1]/a.png was requested as http://::1/a.png (the host rebuilt from
    `hostname`, which drops the brackets): "Name or service not known"."""
    from pipelines.image_file import _without_credentials

    assert _without_credentials("http://u:p@[::1]/a.png")[0] == "http://[::1]/a.png"
    assert _without_credentials("http://u:p@[fd00::5]:8080/a.png")[0] == "http://[fd00::5]:8080/a.png"
    assert _without_credentials("http://u:p%40x@nas.local:8000/a.png?x=1")[0] == "http://nas.local:8000/a.png?x=1"
