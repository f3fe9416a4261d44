"""The running batch's bookkeeping checked against the steps in flight (EngineConfig.debug_checks).

Run by the engine thread after each round of commits; an AssertionError (a bookkeeping bug)
fails the engine like any other. Nothing here changes the Batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .scheduler import members

if TYPE_CHECKING:
    from .batch import Batch


def check_invariants(batch: Batch, depth: int) -> None:
    """After the commits (debug_checks): fewer than `depth` steps in flight, and the count of
    in-flight steps each sequence and image keeps (what releases them) is exactly the number
    of those steps that include it."""
    assert len(batch.inflight) < depth, (len(batch.inflight), depth)
    seqs: dict[int, int] = {}
    images: dict[int, int] = {}
    for record in batch.inflight:
        for seq in members(record.plan):
            assert seq.id in batch.seqs, f"request {seq.id} released while a step holds it"
            seqs[seq.id] = seqs.get(seq.id, 0) + 1
        for img in record.plan.images:
            assert img.id in batch.images, f"image {img.id} released while a step holds it"
            images[img.id] = images.get(img.id, 0) + 1
    for seq in batch.seqs.values():
        assert seq.inflight == seqs.get(seq.id, 0), (seq.id, seq.inflight, seqs.get(seq.id, 0))
    for img in batch.images.values():
        assert img.inflight == images.get(img.id, 0), (img.id, img.inflight, images.get(img.id, 0))
    waiting: dict[int, int] = {}
    for seq in batch.waiting:
        waiting[id(seq.image)] = waiting.get(id(seq.image), 0) + 1
    for img in batch.images.values():
        assert img.waiting == waiting.get(id(img), 0) and img.holders >= img.ref_held + img.waiting
        assert not (img.staged and img.launched and not img.encoding), "launched before the vision stage"
