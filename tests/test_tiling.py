import dataclasses
import random

import numpy as np
import pytest
import torch

from engine.config import ConfigError, ModelConfig, VisionConfig
from engine.models.tiling import (crops_to_tensor, fill_tiling, overlap_crops, page_to_grey, reconstruct,
                                  select_tiling)

MD2 = ModelConfig().vision  # patch 14, crop 378, margin 4 patches = 56 px, window 266 px


@pytest.mark.parametrize("width, height, tiling", [
    (1, 1, (1, 1)),
    (378, 378, (1, 1)),
    (379, 1000, (6, 2)),
    (1000, 379, (2, 6)),
    (8000, 300, (1, 1)),
    (300, 8000, (1, 1)),
    (4000, 3000, (2, 4)),
    (3000, 4000, (4, 2)),
    (1920, 1080, (2, 4)),
    (800, 600, (2, 4)),
    (640, 480, (2, 4)),
    (1000, 1000, (3, 3)),
    (1412, 392, (2, 6)),  # raised to the minimum, then the larger side shrunk back to fit
    (489, 489, (3, 3)),  # minimum 2x2, but the square root of 12 allows 3x3
    (7600, 400, (1, 12)),  # the published code gives 1x13 here; we cap at max_crops
    (1612, 712, (2, 4)),  # minimum 3x6 is over 12: scaled by sqrt(12/18) and floored (rounded: 2x5)
])
def test_grid_and_crop_count(width, height, tiling):
    img = np.zeros((height, width, 3), dtype=np.uint8)
    crops, got = overlap_crops(img, MD2)
    assert got == tiling
    assert crops.shape == (tiling[0] * tiling[1] + 1, 378, 378, 3)
    assert crops.dtype == np.uint8


def test_never_more_than_max_crops_plus_one():
    rng = random.Random(0)
    for max_crops in (1, 2, 4, 12, 16):
        for _ in range(2000):
            h, w = rng.randint(-200, 20000), rng.randint(-200, 20000)
            rows, cols = select_tiling(h, w, 266, max_crops)
            assert rows >= 1 and cols >= 1
            assert rows * cols <= max(max_crops, 1), (h, w, max_crops, rows, cols)


TINY = VisionConfig(enc_dim=96, enc_patch_size=14, enc_n_layers=2, enc_ff_dim=384, enc_n_heads=2,
                    proj_inner_dim=512, proj_out_dim=192, crop_size=126, max_crops=8, overlap_margin=1,
                    resample="bicubic", tiling="fill")  # window 98 px
TINY_PUBLISHED = dataclasses.replace(TINY, tiling="moondream")


@pytest.mark.parametrize("width, height, published, fill", [
    (160, 120, (1, 1), (2, 3)),  # no taller than a window: one tile by the published rule
    (240, 120, (1, 1), (2, 4)),
    (120, 160, (1, 1), (3, 2)),
    (2560, 1080, (1, 4), (2, 4)),  # 21:9: one row of four
    (1920, 820, (1, 4), (2, 4)),
    (640, 360, (2, 3), (2, 3)),  # frames the published rule tiles in 2+ rows and columns: as before
    (1920, 1080, (2, 3), (2, 3)),
    (640, 480, (2, 3), (2, 3)),
    (360, 640, (3, 2), (3, 2)),
])
def test_fill_tiling_tiles_small_and_wide_frames(width, height, published, fill):
    img = np.zeros((height, width, 3), dtype=np.uint8)
    assert overlap_crops(img, TINY_PUBLISHED)[1] == published
    crops, got = overlap_crops(img, TINY)
    assert got == fill and crops.shape == (fill[0] * fill[1] + 1, 126, 126, 3)


def test_fill_tiling_never_exceeds_max_crops_nor_tiles_less():
    rng = random.Random(1)
    for max_crops in (1, 2, 3, 4, 8, 12):
        for _ in range(2000):
            h, w = rng.randint(-50, 5000), rng.randint(-50, 5000)
            rows, cols = fill_tiling(h, w, 98, max_crops)
            assert 1 <= rows * cols <= max_crops, (h, w, max_crops, rows, cols)
            published = select_tiling(h, w, 98, max_crops)
            assert rows * cols >= published[0] * published[1]
            if min(rows, cols) == 1:  # a single row or column only where two would not fit
                assert 2 * rows * cols > max_crops, (h, w, max_crops, rows, cols)


def test_fill_tiling_upsamples_a_small_frame_into_its_tiles():
    """A 160x120 frame's object spans about twice the pixels in a fill tile as in the one crop
    the published rule gives it."""
    img = np.zeros((120, 160, 3), dtype=np.uint8)
    img[50:70, 70:90] = 255  # a 20 px square in the middle
    published, _ = overlap_crops(img, TINY_PUBLISHED)
    fill, _ = overlap_crops(img, TINY)
    widest = lambda crops: max(int((c[..., 0] > 127).any(0).sum()) for c in crops[1:])  # noqa: E731
    assert widest(fill) >= 1.8 * widest(published)


def test_an_unknown_tiling_is_a_config_error():
    with pytest.raises(ConfigError, match="vision.tiling"):
        ModelConfig.from_dict({"vision": {"tiling": "tiles"}})


def test_global_crop_first_and_tiles_row_major():
    # A 2x2-tiled image whose quadrants differ: each tile's centre must come from its own quadrant.
    cfg = VisionConfig(enc_patch_size=14, crop_size=56, overlap_margin=1, max_crops=4,
                       enc_dim=64, enc_n_heads=1, proj_out_dim=2048)
    img = np.zeros((112, 112, 3), dtype=np.uint8)  # window 28, margin 14: resized to 2*28+28 = 84
    img[:56, :56] = (255, 0, 0)
    img[:56, 56:] = (0, 255, 0)
    img[56:, :56] = (0, 0, 255)
    img[56:, 56:] = (255, 255, 255)
    crops, tiling = overlap_crops(img, cfg)
    assert tiling == (2, 2)
    assert crops.shape[0] == 5
    centre = [tuple(int(v) for v in c[20, 20]) for c in crops[1:]]
    assert centre == [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]
    # The global crop is the whole image: all four colours appear in it.
    g = crops[0]
    assert tuple(g[5, 5]) == (255, 0, 0) and tuple(g[50, 50]) == (255, 255, 255)


def test_large_frames_resize_close_to_plain_lanczos():
    # The box pre-reduction that makes HD frames cheap must not change what the model sees: the
    # global crop and the first tile of a 1080p scene within a few levels of a plain Lanczos.
    from PIL import Image

    from tinyvlm import world

    rgb = world.render(world.sample_scene(np.random.default_rng(7), 1920, 1080))
    crops, (rows, cols) = overlap_crops(rgb, MD2)
    c, margin = MD2.crop_size, MD2.enc_patch_size * MD2.overlap_margin
    window = c - 2 * margin
    plain_global = Image.fromarray(rgb).resize((c, c), Image.Resampling.LANCZOS)
    plain_big = Image.fromarray(rgb).resize((cols * window + 2 * margin, rows * window + 2 * margin),
                                            Image.Resampling.LANCZOS)
    for crop, plain in ((crops[0], np.asarray(plain_global)), (crops[1], np.asarray(plain_big)[:c, :c])):
        diff = np.abs(crop.astype(int) - plain.astype(int))
        assert diff.max() <= 8 and diff.mean() < 0.5, (diff.max(), diff.mean())


@pytest.mark.parametrize("size", [(640, 480), (1000, 379), (300, 200)])
def test_moondream_crops_are_pils_lanczos_exactly(size):
    # Where the box pre-reduction does not apply (shrinking by under 4x, or enlarging), the crops
    # are PIL's Lanczos to the level: the filter Moondream 2 was trained with. A bicubic here
    # stayed within the 1080p test's tolerance.
    from PIL import Image

    from tinyvlm import world

    rgb = world.render(world.sample_scene(np.random.default_rng(5), *size))
    crops, (rows, cols) = overlap_crops(rgb, MD2)
    c, margin = MD2.crop_size, MD2.enc_patch_size * MD2.overlap_margin
    window = c - 2 * margin
    pil = Image.fromarray(rgb)
    big = np.asarray(pil.resize((cols * window + 2 * margin, rows * window + 2 * margin), Image.Resampling.LANCZOS))
    assert np.array_equal(crops[0], np.asarray(pil.resize((c, c), Image.Resampling.LANCZOS)))
    for i in range(rows):
        for j in range(cols):
            assert np.array_equal(crops[1 + i * cols + j], big[i * window:i * window + c, j * window:j * window + c])


@pytest.mark.parametrize("size", [(640, 360), (1920, 1080), (333, 251)])
def test_bicubic_resample_is_pils_antialiased_bicubic(size):
    # The tiny model's filter (config resample "bicubic") runs through torch's kernel; it must be
    # the filter its accuracy was measured with: PIL's BICUBIC, within a level of rounding.
    import dataclasses

    from PIL import Image

    from tinyvlm import world

    tiny = dataclasses.replace(VisionConfig(enc_dim=128, enc_n_heads=2, crop_size=126, max_crops=4,
                                            overlap_margin=1, proj_out_dim=192), resample="bicubic")
    rgb = world.render(world.sample_scene(np.random.default_rng(3), *size))
    rgb.flags.writeable = False  # frames from PIL and PyAV often are
    crops, (rows, cols) = overlap_crops(rgb, tiny)
    c, margin = tiny.crop_size, tiny.enc_patch_size * tiny.overlap_margin
    window = c - 2 * margin
    pil = Image.fromarray(rgb)
    ref_global = np.asarray(pil.resize((c, c), Image.Resampling.BICUBIC))
    ref_big = np.asarray(pil.resize((cols * window + 2 * margin, rows * window + 2 * margin), Image.Resampling.BICUBIC))
    assert np.abs(crops[0].astype(int) - ref_global).max() <= 1
    assert np.abs(crops[-1].astype(int) - ref_big[-c:, -c:]).max() <= 1
    assert not np.array_equal(crops, overlap_crops(rgb, dataclasses.replace(tiny, resample="lanczos"))[0])


@pytest.mark.parametrize("size", [(640, 360), (160, 120), (1280, 720)])
def test_bicubic_crops_are_torchs_interpolate_to_the_level(size):
    # The crops are written in place by the kernel F.interpolate runs; the values the shipped
    # weights were measured with must not move by one level.
    import torch.nn.functional as F

    from tinyvlm import world

    cfg = VisionConfig(enc_dim=96, enc_n_heads=2, crop_size=126, max_crops=8, overlap_margin=1,
                       proj_out_dim=192, resample="bicubic", tiling="fill")
    rgb = world.render(world.sample_scene(np.random.default_rng(4), *size))
    crops, (rows, cols) = overlap_crops(rgb, cfg)
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None]
    c, window = 126, 126 - 28

    def resized(h, w):
        return F.interpolate(x, size=(h, w), mode="bicubic", antialias=True)[0].permute(1, 2, 0).numpy()

    assert np.array_equal(crops[0], resized(c, c))
    big = resized(rows * window + 28, cols * window + 28)
    for i in range(rows):
        for j in range(cols):
            assert np.array_equal(crops[1 + i * cols + j], big[i * window:i * window + c, j * window:j * window + c])


@pytest.mark.parametrize("tiling", [(1, 1), (1, 3), (2, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("grid, margin", [(27, 4), (8, 1), (6, 2)])
def test_reconstruction_of_tiles(tiling, grid, margin):
    rows, cols = tiling
    step = grid - 2 * margin
    full = torch.randn(rows * step + 2 * margin, cols * step + 2 * margin, 5)
    tiles = torch.stack([full[i * step: i * step + grid, j * step: j * step + grid]
                         for i in range(rows) for j in range(cols)])
    assert torch.equal(reconstruct(tiles, tiling, margin), full)


def test_reconstruction_keeps_outer_margins_only():
    # Tiles filled with their own index: inner margins must come from the neighbour's centre.
    grid, margin = 6, 2
    tiles = torch.stack([torch.full((grid, grid, 1), float(i)) for i in range(2)])
    out = reconstruct(tiles, (1, 2), margin)[..., 0]
    assert out.shape == (6, 2 * 2 + 4)
    assert out[:, : 2 + 2].eq(0).all() and out[:, 4:].eq(1).all()


def test_normalisation():
    crops = np.array([[[[0, 255, 127]]]], dtype=np.uint8)
    x = crops_to_tensor(crops, torch.device("cpu"), torch.float32)
    assert x.shape == (1, 3, 1, 1)
    assert torch.allclose(x.flatten(), torch.tensor([-1.0, 1.0, 127 / 255 * 2 - 1]))


def test_rejects_non_rgb_arrays():
    with pytest.raises(ValueError):
        overlap_crops(np.zeros((10, 10), dtype=np.uint8), MD2)


def test_a_white_or_black_page_is_shown_mid_grey_and_what_is_on_it_kept():
    rgb = np.full((60, 80, 3), 250, np.uint8)  # a white page, slightly off
    rgb[10:30, 10:30] = (220, 40, 40)  # a red square on it
    rgb[35:55, 40:70] = (128, 110, 90)  # a brown card on it, holding a white disc
    rgb[40:50, 50:60] = 245
    out = page_to_grey(rgb)
    assert (out[0, 0] == 128).all() and (out[32, 5] == 128).all()  # the page
    assert (out[10:30, 10:30] == (220, 40, 40)).all() and (out[40:50, 50:60] == 245).all()  # kept
    assert page_to_grey(np.where(rgb == 250, 5, rgb).astype(np.uint8))[0, 0].tolist() == [128, 128, 128]  # black
    scene = np.full((60, 80, 3), 150, np.uint8)  # a world background: not a page, nothing changes
    scene[20:40, 20:40] = 245
    assert page_to_grey(scene) is scene
    cfg = VisionConfig(crop_size=56, enc_patch_size=14, overlap_margin=1, max_crops=4)
    paged = dataclasses.replace(cfg, page_to_grey=True)
    assert not np.array_equal(overlap_crops(rgb, cfg)[0], overlap_crops(rgb, paged)[0])
    assert np.array_equal(overlap_crops(rgb, paged)[0], overlap_crops(page_to_grey(rgb), cfg)[0])


@pytest.mark.parametrize("level", [255, 0])
def test_a_page_is_half_the_edge_within_the_tolerance_in_every_channel(level):
    from engine.models.tiling import PAGE_GREY, PAGE_TOLERANCE

    near = level - PAGE_TOLERANCE if level else PAGE_TOLERANCE  # the farthest still near
    far = near - 1 if level else near + 1

    def frame(edge_value, share: float, channel: int | None = None) -> np.ndarray:
        rgb = np.full((40, 60, 3), 128, np.uint8)  # a mid-grey inside that is no page's colour
        mask = np.zeros((40, 60), bool)
        mask[0], mask[-1], mask[:, 0], mask[:, -1] = True, True, True, True
        ys, xs = np.nonzero(mask)
        k = int(round(share * len(ys)))
        value = np.full(3, near, np.uint8)
        if channel is not None:
            value[channel] = edge_value
        else:
            value[:] = edge_value
        rgb[ys[:k], xs[:k]] = value
        return rgb

    assert page_to_grey(frame(near, 0.5))[0, 0].tolist() == [PAGE_GREY] * 3  # half the edge: a page
    unchanged = [frame(near, 0.45), frame(far, 1.0)] + [frame(far, 1.0, c) for c in range(3)]
    for rgb in unchanged:  # less than half; one level past the tolerance, in any one channel
        assert page_to_grey(rgb) is rgb


def test_an_object_cut_by_the_pages_edge_leaves_the_rest_of_the_picture_as_it_is():
    """A drawing on paper whose red square runs off the page's left edge: only the page turns
    grey; the square and the blue card in the middle keep their colours."""
    rgb = np.full((60, 80, 3), 250, np.uint8)  # a white page
    rgb[20:40, 0:15] = (220, 40, 40)  # a red square cut by the frame's edge
    rgb[35:55, 40:70] = (30, 90, 200)  # a blue card inside
    out = page_to_grey(rgb)
    assert (out[0, 0] == 128).all() and (out[5, 40] == 128).all()  # the page
    assert (out[20:40, 0:15] == (220, 40, 40)).all() and (out[35:55, 40:70] == (30, 90, 200)).all()
