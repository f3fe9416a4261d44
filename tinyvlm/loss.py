"""The training loss of the tiny model: next-token loss on answers (and region losses), plus a
training-only probe (`PatchProbe`, never saved) whose colour, shape and outline targets on the
image tokens teach the vision encoder what the captions are about.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.moondream import MoondreamModel
from engine.models.tiling import crops_to_tensor
from engine.models.vision import sdpa

from .data import PATCH_COLORS, PATCH_SHAPES
from .regions import region_loss, with_regions

AUX_WEIGHT = 0.5
AUX_BACKGROUND_WEIGHT = 0.2  # most cells are background; objects are what the captions are about
# The outline target (object pixels of each patch of every crop): in a vision-only probe on
# single-object scenes, shape read off the mean image token stayed at chance (0.25) for 40 k images
# without it and rose to ~0.31 with it; a per-pixel target is the densest signal about outlines.
# The tiles get the same target with a weight of their own (the global crop's is unchanged):
# small objects, where shape answers fail, are twice as large there.
OUTLINE_WEIGHT = 1.0
TILE_OUTLINE_WEIGHT = 1.0


class PatchProbe(torch.nn.Module):
    """Training-only heads reading colour and shape off each image token, and the object pixels
    of each patch off the encoder's features of every crop (never saved)."""

    def __init__(self, dim: int, enc_dim: int, patch_pixels: int):
        super().__init__()
        self.color = torch.nn.Linear(dim, len(PATCH_COLORS))
        self.shape = torch.nn.Linear(dim, len(PATCH_SHAPES))
        self.outline = torch.nn.Linear(enc_dim, patch_pixels)

    def loss(self, image_BND: torch.Tensor, labels_B2N: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        """(loss, colour accuracy, shape accuracy), accuracies on object cells."""
        total, accs = image_BND.new_zeros(()), []
        for head, y in ((self.color, labels_B2N[:, 0]), (self.shape, labels_B2N[:, 1])):
            logits = head(image_BND).float().flatten(0, 1)
            y = y.flatten()
            w = torch.where(y > 0, 1.0, AUX_BACKGROUND_WEIGHT)
            total = total + (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
            obj = y > 0
            accs.append(int((logits[obj].argmax(-1) == y[obj]).sum()) / max(int(obj.sum()), 1))
        return total, accs[0], accs[1]

    def outline_loss(self, feats_BND: torch.Tensor, outline_BNP: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.outline(feats_BND).float(), outline_BNP.float())


def forward_loss(model: MoondreamModel, batch, probe: PatchProbe | None = None, vision_only: bool = False,
                 frozen_vision: bool = False):
    """Next-token loss on answers plus, where the batch has region blocks, the coordinate and size
    losses; with a probe, also (aux loss, colour accuracy, shape accuracy). vision_only: the encoder
    and projection on the probe's targets alone (answer loss None). frozen_vision: the image tokens
    without gradients (no probe then)."""
    cfg = model.config
    crops = crops_to_tensor(batch.crops.numpy(), torch.device("cpu"), torch.float32)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen_vision):
        feats = model.vision.encode(crops)
        tokens, start, is_global = [], 0, torch.zeros(feats.shape[0], dtype=torch.bool)
        for n, tiling in zip(batch.n_crops, batch.tilings):
            tokens.append(model.vision.project(feats[start:start + n], tiling))
            is_global[start] = True
            start += n
        image_BND = torch.stack(tokens)
    loss = None
    if not vision_only:
        bos = model.text.embed(torch.tensor([cfg.tokenizer.bos_id]))
        text_BTC = with_regions(model, model.text.embed(batch.ids), batch)
        x = torch.cat([bos.expand(len(tokens), 1, -1), image_BND.to(text_BTC.dtype), text_BTC], dim=1)

        def attend(_layer, q, k, v):
            return sdpa(q, k, v, attn_mask=batch.mask)

        h = model.text(x, batch.positions, attend)
        keep = batch.targets >= 0
        logits = model.text.logits(h[keep])
        loss = F.cross_entropy(logits.float(), batch.targets[keep]) + region_loss(model, h, batch)
        if probe is None:
            return loss
    aux, color_acc, shape_acc = probe.loss(image_BND, batch.labels)
    aux = aux + (OUTLINE_WEIGHT * probe.outline_loss(feats[is_global], batch.outline[is_global])
                 + TILE_OUTLINE_WEIGHT * probe.outline_loss(feats[~is_global], batch.outline[~is_global])) / AUX_WEIGHT
    return loss, aux, color_acc, shape_acc
