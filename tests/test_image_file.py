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
