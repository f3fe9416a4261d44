"""Overlap-crop tiling of an image into encoder crops, and the inverse stitching of features.

Contract (shared/MOONDREAM2.md): with patch P, crop C and margin m = P * overlap_margin pixels,
the window w = C - 2m; the grid comes from the image reduced by 2m per axis; the image is resized
(Lanczos, see `_resize`) to (rows*w + 2m, cols*w + 2m) and cut into C x C tiles at stride w, zero
padded at the edges; crop 0 is the whole image resized to C x C. At most max_crops + 1 crops.
A model whose config says `resample: "bicubic"` (the embedded tiny model) gets antialiased
bicubic resizes instead (`_resize_bicubic`), and one that says `tiling: "fill"` gets
`fill_tiling` instead of `select_tiling`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from PIL import Image

from ..config import VisionConfig


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of tiles for an image of height x width (already reduced by the margins)."""
    if height <= window or width <= window:
        return 1, 1
    min_h = math.ceil(height / window)
    min_w = math.ceil(width / window)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        rows, cols = max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio))
        # Deviation from the published code, for extreme aspect ratios only (e.g. 7600x400):
        # raising a side from 0 to 1 can overshoot max_crops there; shrink the long side back.
        if rows * cols > max_crops:
            rows, cols = (rows, max_crops // rows) if cols > rows else (max_crops // cols, cols)
        return max(1, rows), max(1, cols)
    rows = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if rows * cols > max_crops:
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return max(1, rows), max(1, cols)


def fill_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """`select_tiling` for a frame whose short side is at least two windows, then a single row
    (or column) of tiles doubled where two fit in max_crops.

    The published rule gives a frame no taller (or wider) than one window a single tile, and a
    21:9 frame one row of four: their objects are seen at the frame's own size or smaller, and a
    small object there covers one or two patches. Tiling them as a larger frame would be tiled
    upsamples them into the tiles (no new detail, but every object spread over 2-4x the patches);
    frames the published rule already tiles in 2+ rows and columns (4:3 to 2:1 from ~240 px up)
    are tiled as before. At most max_crops tiles, as before.
    """
    published = select_tiling(height, width, window, max_crops)
    short = min(height, width)
    if short < 2 * window:
        scale = 2 * window / max(short, 1)
        height, width = math.ceil(height * scale), math.ceil(width * scale)
    rows, cols = select_tiling(height, width, window, max_crops)
    if rows == 1 and 2 * cols <= max_crops:
        rows = 2
    if cols == 1 and 2 * rows <= max_crops:
        cols = 2
    # The published rule is not monotonic in size for extreme aspect ratios (a 4x2 can become 5x1
    # when scaled up): never fewer tiles than it gives the frame as it is.
    return (rows, cols) if rows * cols >= published[0] * published[1] else published


# Shrinking by more than 2x, first average by an integer factor (a box filter), then Lanczos the
# rest: what pyvips' resize does by default (its `gap` 2.0), and so Moondream's own preprocessing.
# Within a few levels of a plain Lanczos (PSNR >= 51 dB on generated scenes; held-out accuracy of
# the tiny model within 0.2 points), and the tiny model's crops of a 1080p frame take 5.6 ms
# instead of 31 (720p: 4.9 instead of 15), which had capped a 1080p live stream at 28 fps.
REDUCING_GAP = 2.0


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.LANCZOS,
                                                  reducing_gap=REDUCING_GAP))


def _resize_bicubic(rgb_1CHW: torch.Tensor, out_HW3: np.ndarray) -> None:
    """Antialiased bicubic (PIL's BICUBIC filter, support scaled with the shrink factor) of the
    image into out (H, W, 3) uint8, in place, through torch's uint8 kernel. The tiny model
    answers the same as with PIL's Lanczos (held-out accuracy within 0.4 points on every
    metric, EVAL.md), at a fraction of its time.

    Why `out=`: `F.interpolate` runs the same kernel but returns planar (1, 3, H, W) memory, and
    copying tiles out of a planar image cost more than the resize (0.8 ms of a 640x360 frame's
    2.6 ms of crops on an Intel Xeon); handed a channels-last view of `out`, the kernel writes
    the (H, W, 3) pixels where they are read (same values, tested).
    """
    h, w = out_HW3.shape[:2]
    dst = torch.from_numpy(out_HW3).permute(2, 0, 1)[None]  # (1, 3, H, W) channels-last view
    torch.ops.aten._upsample_bicubic2d_aa.out(rgb_1CHW, [h, w], False, None, None, out=dst)


PAGE_TOLERANCE = 40  # per channel, from pure white (255) or black (0)
PAGE_GREY = 128


def page_to_grey(rgb_HW3: np.ndarray) -> np.ndarray:
    """The frame with its page, if it has one, shown mid grey: where at least half of the frame's
    edge is near pure white (or black), every near-white (near-black) pixel joined to the edge
    through such pixels. Objects of that colour inside the page keep it; a frame without such an
    edge comes back as it is (the check reads the edge alone)."""
    rgb = rgb_HW3
    edge = np.concatenate([rgb[0], rgb[-1], rgb[1:-1, 0], rgb[1:-1, -1]])
    # Every channel within the tolerance of white is the least one at 255 - T or more, of black
    # the greatest at T or less: read on the uint8 values (12 us a 640x360 frame), not as
    # |v - level| on an int16 copy nor by .min(axis=1) over 3 values (~95 us each, ~1 % of the
    # CPU of a live frame's every step)
    r, g, b = edge[:, 0], edge[:, 1], edge[:, 2]
    least, most = np.minimum(np.minimum(r, g), b), np.maximum(np.maximum(r, g), b)
    for level in (255, 0):
        near_edge = least >= level - PAGE_TOLERANCE if level else most <= PAGE_TOLERANCE
        if 2 * int(np.count_nonzero(near_edge)) < len(edge):
            continue
        import cv2

        # One pass for the mask, the page's labels looked up (np.isin sorts them), the grey put
        # through a mask: a 12000x12000 picture had taken 14 s and 3.1 GB here (int16 copies).
        lo, hi = (level - PAGE_TOLERANCE, level) if level else (0, PAGE_TOLERANCE)
        near = cv2.inRange(rgb, (lo,) * 3, (hi,) * 3)
        n, labels = cv2.connectedComponents(near, connectivity=4)
        del near
        keep = np.zeros(n, dtype=bool)
        keep[np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]])] = True
        keep[0] = False  # the pixels that are not near the level
        page = keep[labels]
        del labels
        out = np.array(rgb)
        np.copyto(out, np.uint8(PAGE_GREY), where=page[..., None])
        return out
    return rgb


def overlap_crops(rgb_HW3: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """Crops (N, C, C, 3) uint8, global first then tiles row-major, and the (rows, cols) tiling."""
    if rgb_HW3.dtype != np.uint8 or rgb_HW3.ndim != 3 or rgb_HW3.shape[2] != 3:
        raise ValueError(f"expected an RGB uint8 array of shape (H, W, 3), got {rgb_HW3.dtype} {rgb_HW3.shape}")
    if cfg.page_to_grey:
        rgb_HW3 = page_to_grey(rgb_HW3)
    h, w = rgb_HW3.shape[:2]
    c = cfg.crop_size
    margin = cfg.enc_patch_size * cfg.overlap_margin
    window = c - 2 * margin
    tiling = fill_tiling if cfg.tiling == "fill" else select_tiling
    rows, cols = tiling(h - 2 * margin, w - 2 * margin, window, cfg.max_crops)

    crops = np.zeros((rows * cols + 1, c, c, 3), dtype=np.uint8)
    big_h, big_w = rows * window + 2 * margin, cols * window + 2 * margin
    if cfg.resample == "bicubic":
        # An (H, W, 3) array viewed as (1, 3, H, W) is channels-last already: no copy. Frames may
        # be read-only arrays (PIL, PyAV); they are only read here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            x = torch.from_numpy(np.ascontiguousarray(rgb_HW3)).permute(2, 0, 1)[None]
        big = np.empty((big_h, big_w, 3), dtype=np.uint8)
        with torch.inference_mode():
            _resize_bicubic(x, crops[0])
            _resize_bicubic(x, big)
    else:
        crops[0] = _resize(rgb_HW3, c, c)
        big = _resize(rgb_HW3, big_h, big_w)
    for i in range(rows):
        for j in range(cols):
            tile = big[i * window : i * window + c, j * window : j * window + c]
            crops[1 + i * cols + j, : tile.shape[0], : tile.shape[1]] = tile
    return crops, (rows, cols)


def crops_to_tensor(crops_NCC3: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """uint8 crops -> (N, 3, C, C) normalised to [-1, 1] as (x / 255 - 0.5) / 0.5."""
    return normalize_crops(stage_crops(crops_NCC3, device), dtype)


def stage_crops(crops_NCC3: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 crops as a tensor on `device`, the copy queued on the current stream.

    On CUDA the copy goes through pinned memory and does not wait: a blocking copy synchronises
    its stream, and on the engine's compute stream that would make the host wait for the step
    before it (no pipelining for any step that encodes an image). On CPU it shares the array.
    """
    x = torch.from_numpy(np.ascontiguousarray(crops_NCC3))
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def normalize_crops(crops_NCC3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 crops (N, C, C, 3), any device -> (N, 3, C, C) of `dtype` in [-1, 1]."""
    x = crops_NCC3.permute(0, 3, 1, 2).to(dtype)
    return x.div_(255.0).sub_(0.5).div_(0.5)


def reconstruct(tiles_NhwD: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """Stitch per-tile maps (N, h, w, D) into one (H, W, D) map.

    Neighbouring tiles overlap by 2 * margin; each keeps its margin only on the outer edges of
    the whole image, so every output cell comes from exactly one tile.
    """
    rows, cols = tiling
    n, th, tw, d = tiles_NhwD.shape
    if n != rows * cols:
        raise ValueError(f"{n} tiles do not fill a {rows}x{cols} tiling")
    step_h, step_w = th - 2 * margin, tw - 2 * margin
    out = tiles_NhwD.new_zeros((step_h * rows + 2 * margin, step_w * cols + 2 * margin, d))
    for idx in range(n):
        i, j = divmod(idx, cols)
        y0 = 0 if i == 0 else margin
        y1 = th if i == rows - 1 else th - margin
        x0 = 0 if j == 0 else margin
        x1 = tw if j == cols - 1 else tw - margin
        out[i * step_h + y0 : i * step_h + y1, j * step_w + x0 : j * step_w + x1] = tiles_NhwD[idx, y0:y1, x0:x1]
    return out
