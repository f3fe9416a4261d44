"""Training data: rendered scenes, their crops, and token sequences for every task on them.

One training item is one image and K tasks on it (the three captions and a few questions).
The text side of an item is packed as [BOS, image tokens] + K blocks of (prompt, answer, EOS);
each block sees the image prefix and itself (causally), never the other blocks, and starts at
position prefix_len, exactly as at inference. Seeds make items reproducible: item i of a split
is drawn from `numpy.random.default_rng([split_seed, i])`.

Each item also carries per-patch labels (colour and shape of the object under each cell of the
image-token grid) for an auxiliary loss used only in training: a few caption tokens per image are
a thin signal for a vision encoder learning from scratch; a label per image token is a dense one.
It also carries the objects' pixel mask on every crop, patch by patch: predicting which pixels
of its patch are object makes each token encode the outline it sees, which shape needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.config import ModelConfig, VisionConfig
from engine.models.prompt import prompt_ids
from engine.models.tiling import overlap_crops
from engine.models.tokenizer import Tokenizer

from .language import caption, questions
from .regions import RegionBlock, region_blocks
from .world import COLORS, SHAPES, Obj, Scene, render, sample_scene

PATCH_COLORS = ("background",) + tuple(COLORS)  # label 0 = no object
PATCH_SHAPES = ("background",) + SHAPES
_CELL = 8  # label mask pixels per grid cell

TRAIN_SEED = 0
HELDOUT_SEED = 1_000_003  # never used for training
# Exact short answers are most of the eval; their tokens are a small share of a caption-heavy item.
QUESTIONS_PER_ITEM = 5
# Frames are drawn at most this wide in training: the tiles never use more than ~320 px of a
# frame's width (1x2 or 1x3 tiles of 126 px), and rendering 640 px costs half of 960 (6.9 vs 13.6 ms).
TRAIN_MAX_WIDTH = 640


@dataclass
class Item:
    crops: np.ndarray  # uint8 (N, C, C, 3)
    tiling: tuple[int, int]
    blocks: list[tuple[list[int], list[int]] | RegionBlock]  # (prompt ids, answer ids + EOS), or a region task
    labels: np.ndarray  # int64 (2, grid * grid): colour and shape index per image token
    outline: np.ndarray  # uint8 (N, grid * grid, patch * patch): object pixels of each crop, per patch


def _draw_objects(scene: Scene, width: int, height: int) -> np.ndarray:
    """uint8 (height, width) map of object k+1 per pixel (0 = none), the frame scaled to that size;
    later objects are drawn on top, as in render()."""
    from PIL import Image, ImageDraw

    sx, sy = width / scene.width, height / scene.height
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    for k, o in enumerate(scene.objects, start=1):
        if o.shape == "circle":
            r = o.extent / 2
            draw.ellipse(((o.cx - r) * sx, (o.cy - r) * sy, (o.cx + r) * sx, (o.cy + r) * sy), fill=k)
        else:
            draw.polygon([(x * sx, y * sy) for x, y in o.polygon()], fill=k)
    return np.asarray(mask)


def _by_cell(map_HW: np.ndarray, grid: int) -> np.ndarray:
    """(grid * c, grid * c) -> (grid * grid, c * c): the pixels of each cell, cells row-major."""
    c = map_HW.shape[0] // grid
    return np.ascontiguousarray(map_HW.reshape(grid, c, grid, c).transpose(0, 2, 1, 3).reshape(grid * grid, c * c))


def outline_mask(scene: Scene, vision: VisionConfig) -> np.ndarray:
    """Object pixels (0/1) of every crop the encoder sees (global, then tiles), as
    (crops, patches, patch * patch) in the encoder's patch order.

    The mask goes through the same `overlap_crops` as the frame, so its crops line up with the
    image's. Tiles matter most: there a small object has ~10-20 px against ~5-10 in the global
    crop, and small objects are where shape answers fail (EVAL.md).
    """
    on = (_draw_objects(scene, scene.width, scene.height) > 0).astype(np.uint8) * 255
    # A mask, not a picture: its black is no page to show grey (every pixel had become "object")
    crops, _ = overlap_crops(np.repeat(on[..., None], 3, axis=2), replace(vision, page_to_grey=False))
    return np.stack([_by_cell((c[..., 0] > 127).astype(np.uint8), vision.grid) for c in crops])


def centre_cell(scene: Scene, o: Obj, grid: int) -> tuple[int, int]:
    """(row, col) of the grid x grid split of the frame that holds the object's centre."""
    return min(int(o.cy * grid / scene.height), grid - 1), min(int(o.cx * grid / scene.width), grid - 1)


def patch_labels(scene: Scene, grid: int) -> np.ndarray:
    """Colour and shape of the object covering most of each cell of a grid x grid split of the frame.

    The grid is the image-token grid (the global crop squeezes the frame to a square, so cells are
    frame-relative). A cell holding an object's centre is labelled with that object even when the
    object covers little of it, so small objects are never unlabelled.
    """
    n = grid * _CELL
    cells = _by_cell(_draw_objects(scene, n, n), grid)
    counts = np.stack([(cells == k).sum(1) for k in range(len(scene.objects) + 1)], axis=1)
    counts[:, 0] = np.maximum(counts[:, 0] - cells.shape[1] * 3 // 4, 0)  # an object covering 1/8+ of a cell wins
    owner = counts.argmax(1)
    for k, o in enumerate(scene.objects, start=1):
        row, col = centre_cell(scene, o, grid)
        owner[row * grid + col] = k
    colour = np.array([0] + [PATCH_COLORS.index(o.color) for o in scene.objects])[owner]
    shape = np.array([0] + [PATCH_SHAPES.index(o.shape) for o in scene.objects])[owner]
    return np.stack([colour, shape]).astype(np.int64)


def make_item(index: int, config: ModelConfig, tokenizer: Tokenizer, split_seed: int = TRAIN_SEED,
              max_width: int = TRAIN_MAX_WIDTH, regions: int = 0) -> Item:
    """regions: detect and point blocks added after the captions and questions (drawn from a
    generator of their own, so the scene and the other blocks are those of an item without)."""
    rng = np.random.default_rng([split_seed, index])
    scene = sample_scene(rng, max_width=max_width)
    crops, tiling = overlap_crops(render(scene), config.vision)
    eos = config.tokenizer.eos_id
    blocks = []
    for length in ("short", "normal", "long"):
        blocks.append((prompt_ids(config, tokenizer, caption=length),
                       tokenizer.encode(caption(scene, length, rng)) + [eos]))
    for q, a in questions(scene, rng, k=QUESTIONS_PER_ITEM):
        blocks.append((prompt_ids(config, tokenizer, question=q), tokenizer.encode(a) + [eos]))
    if regions:
        blocks += region_blocks(scene, np.random.default_rng([split_seed, index, 1]), config, tokenizer, regions)
    v = config.vision
    return Item(crops, tiling, blocks, patch_labels(scene, v.grid), outline_mask(scene, v))


@dataclass
class Batch:
    crops: torch.Tensor  # uint8 (sum N, C, C, 3)
    n_crops: list[int]
    tilings: list[tuple[int, int]]
    ids: torch.Tensor  # (B, T) text token ids after the prefix (0 where padded)
    positions: torch.Tensor  # (B, P + T)
    mask: torch.Tensor  # (B, 1, P + T, P + T) bool
    targets: torch.Tensor  # (B, P + T) next-token targets, -100 where no loss
    labels: torch.Tensor  # (B, 2, grid * grid) per-image-token colour and shape (auxiliary loss)
    outline: torch.Tensor  # uint8 (sum N, grid * grid, patch * patch) object pixels of every crop
    # Region blocks: (b, t) indices into ids (inputs) or into the full P + T sequence (targets)
    coord_in_idx: torch.Tensor | None = None  # (N, 2)
    coord_in: torch.Tensor | None = None  # (N, 1) coordinates fed
    size_in_idx: torch.Tensor | None = None  # (M, 2)
    size_in: torch.Tensor | None = None  # (M, 2) sizes fed
    coord_target_idx: torch.Tensor | None = None  # (N', 2)
    coord_target: torch.Tensor | None = None  # (N',) bins
    size_target_idx: torch.Tensor | None = None  # (M', 2)
    size_target: torch.Tensor | None = None  # (M', 2) bins


def collate(items: list[Item], prefix_len: int) -> Batch:
    texts, poss, tgts, blocks_of = [], [], [], []
    region: dict[str, list] = {k: [] for k in ("ci", "civ", "si", "siv", "ct", "ctv", "st", "stv")}
    for i, it in enumerate(items):
        ids, pos, tgt, blk = [], [], [], []
        for b, block in enumerate(it.blocks):
            prompt, answer = (block.prompt, block.answer) if isinstance(block, RegionBlock) else block
            seq = prompt + answer
            # position j predicts token j+1 of the block; only answer tokens are targets
            t = [-100] * len(seq)
            for j in range(len(prompt) - 1, len(seq) - 1):
                t[j] = seq[j + 1]
            if isinstance(block, RegionBlock):
                at = len(ids)  # the block's first index in ids; + prefix_len in the full sequence
                for j in block.no_token:
                    t[j] = -100
                region["ci"] += [(i, at + j) for j, _ in block.coord_in]
                region["civ"] += [[v] for _, v in block.coord_in]
                region["si"] += [(i, at + j) for j, _ in block.size_in]
                region["siv"] += [list(v) for _, v in block.size_in]
                region["ct"] += [(i, prefix_len + at + j) for j, _ in block.coord_target]
                region["ctv"] += [v for _, v in block.coord_target]
                region["st"] += [(i, prefix_len + at + j) for j, _ in block.size_target]
                region["stv"] += [list(v) for _, v in block.size_target]
            ids += seq
            pos += list(range(prefix_len, prefix_len + len(seq)))
            tgt += t
            blk += [b + 1] * len(seq)
        texts.append(ids), poss.append(pos), tgts.append(tgt), blocks_of.append(blk)
    T = max(len(t) for t in texts)
    B, L = len(items), prefix_len + T
    ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, L, dtype=torch.long)
    targets = torch.full((B, L), -100, dtype=torch.long)
    block = torch.full((B, L), -1, dtype=torch.long)  # 0 = image prefix, -1 = padding
    positions[:, :prefix_len] = torch.arange(prefix_len)
    block[:, :prefix_len] = 0
    for i in range(B):
        n = len(texts[i])
        ids[i, :n] = torch.tensor(texts[i])
        positions[i, prefix_len:prefix_len + n] = torch.tensor(poss[i])
        targets[i, prefix_len:prefix_len + n] = torch.tensor(tgts[i])
        block[i, prefix_len:prefix_len + n] = torch.tensor(blocks_of[i])
    idx = torch.arange(L)
    same = block[:, :, None] == block[:, None, :]
    causal = idx[None, :, None] >= idx[None, None, :]
    sees_prefix = (block[:, None, :] == 0) & (block[:, :, None] >= 0)
    mask = (same & (causal | (block[:, :, None] == 0))) | sees_prefix
    mask |= torch.eye(L, dtype=torch.bool)[None]  # padding rows attend to themselves: no NaN
    crops = torch.from_numpy(np.concatenate([it.crops for it in items]))
    labels = torch.from_numpy(np.stack([it.labels for it in items]))
    outline = torch.from_numpy(np.concatenate([it.outline for it in items]))
    def index(key: str) -> torch.Tensor:
        return torch.tensor(region[key], dtype=torch.long).view(-1, 2)

    return Batch(crops, [len(it.crops) for it in items], [it.tiling for it in items], ids, positions,
                 mask[:, None], targets, labels, outline,
                 index("ci"), torch.tensor(region["civ"], dtype=torch.float32).view(-1, 1),
                 index("si"), torch.tensor(region["siv"], dtype=torch.float32).view(-1, 2),
                 index("ct"), torch.tensor(region["ctv"], dtype=torch.long),
                 index("st"), torch.tensor(region["stv"], dtype=torch.long).view(-1, 2))


class ItemStream(torch.utils.data.IterableDataset):
    """Batches of items, batch b being items start + b * stride onwards (stride: the batch size,
    or a whole step's when several processes share it), generated in a worker process."""

    def __init__(self, config: ModelConfig, tokenizer_path: str, batch_size: int, start: int, n_batches: int,
                 stride: int | None = None, regions: int = 0):
        self.config, self.tokenizer_path, self.regions = config, tokenizer_path, regions
        self.batch_size, self.start, self.n_batches = batch_size, start, n_batches
        self.stride = stride or batch_size

    def __iter__(self):
        torch.set_num_threads(1)
        tok = Tokenizer(self.tokenizer_path)
        for b in range(self.n_batches):
            first = self.start + b * self.stride
            items = [make_item(first + i, self.config, tok, regions=self.regions) for i in range(self.batch_size)]
            yield collate(items, self.config.prefix_len)
