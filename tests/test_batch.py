"""The running batch alone, driven step by step on a scripted fake device: no threads, no model.

Each launched step is committed only when the test says so, so the pipelined states (a step in
flight behind a commit, a zombie sequence) are reached deterministically."""

from types import SimpleNamespace

import torch

from engine.batch import Batch
from engine.kv_cache import PagePool
from engine.request import RequestHandle
from engine.runner import StepResult
from engine.sequence import Image, Sequence
from engine.types import SamplingParams

PREFIX, PAGE, EOS = 20, 8, 0


class _Done:
    def __init__(self, result):
        self.result = result

    def wait(self, timeout=None, poll=False):
        return self.result


class ScriptedRunner:
    """Samples each sequence's tokens from a script, in order (its answer, EOS, what follows)."""

    draft_rows = 0
    busy_ms: dict[str, float] = {}  # what each step reports

    def __init__(self, scripts: dict[int, list[int]]):
        self.scripts = scripts
        self.slots = [SimpleNamespace(busy=False), SimpleNamespace(busy=False)]

    def kv_slots(self, page_table):
        return None

    def launch(self, plan, step_id):
        slot = self.slots[step_id % 2]
        assert not slot.busy, "slot reused before its step was committed"
        slot.busy = True
        rows = [c.seq for c in plan.prefills if c.last] + plan.decodes
        tokens = [self.scripts[s.id][s.launched] for s in rows]  # before launch() counts the row
        return _Done(StepResult(rows, torch.tensor(tokens, dtype=torch.int64), dict(self.busy_ms))), slot


def _batch(scripts, n_pages=64, max_batch=4, budget=512, lower_turn=0):
    config = SimpleNamespace(max_batch_size=max_batch, page_size=PAGE, prefill_token_budget=budget,
                             lower_turn=lower_turn)
    model_config = SimpleNamespace(prefix_len=PREFIX, tokenizer=SimpleNamespace(eos_id=EOS))
    prefix_pages = -(-PREFIX // PAGE)
    return Batch(config, model_config, lambda ids: " ".join(f"w{t}" for t in ids), PagePool(n_pages, PAGE),
                 ScriptedRunner(scripts), prefix_pages, reserve_pages=0, max_draft=0)


def _seq(i, image, max_tokens=8, prompt=3, **params):
    return Sequence(id=i, prompt=list(range(3, 3 + prompt)), params=SamplingParams(max_tokens=max_tokens, **params),
                    image=image, handle=RequestHandle(None, i), capacity=max_tokens)


def _step(batch):
    step = batch.plan()
    assert not step.empty
    batch.launch(step)


def _commit(batch):
    batch.commit(batch.inflight.popleft())


def _run(batch, depth=2):
    """The engine loop's order: launch what can be planned, commit the oldest step once `depth`
    are in flight or nothing more can be planned."""
    while True:
        step = batch.plan()
        if not step.empty:
            batch.launch(step)
        elif not batch.inflight:
            return
        else:
            _commit(batch)
        while len(batch.inflight) >= depth:
            _commit(batch)


def _image(i=1):
    return Image(id=i, crops=None, tiling=(1, 1), holders=0, ref_held=False)


def test_a_zombie_is_finalized_at_once_and_released_only_after_its_last_step():
    """Finalize early, release late: a sequence whose EOS is committed while a later step that
    includes it is in flight ends at once (its result is in, nothing more is emitted) but keeps
    its pages and slot until that step is committed; a cancel meanwhile changes nothing."""
    batch = _batch({1: [5, EOS, 6, 7, 8, 9]})
    seq = _seq(1, _image())
    batch.add_request(seq)
    _step(batch)  # image + prompt, samples 5
    _step(batch)  # decode: EOS
    _commit(batch)  # 5
    _step(batch)  # decode (EOS not known yet): a zombie row, 6
    _commit(batch)  # EOS: finalized, a step still holds it
    assert seq.handle.done() and seq.finalized and seq.inflight == 1
    out = seq.handle.result()
    assert (out.token_ids, out.finish_reason) == ([5], "stop")
    held = batch.pool.n_used
    assert held > 0 and seq in batch.running and seq.slot not in batch.free_slots
    assert batch.plan().empty  # a finalized sequence decodes no more
    batch.cancel(seq.id)  # the caller cancels a request that already finished: a no-op
    assert seq.handle.result() is out and (out.token_ids, out.finish_reason) == ([5], "stop")
    assert batch.pool.n_used == held
    _commit(batch)  # its last step: the token it sampled (6) is dropped, and it is released
    assert seq.handle.result() is out and out.token_ids == [5] and out.text == "w5"
    assert list(seq.handle.stream()) == ["w5"] and batch.tokens == 2  # 5 and EOS; 6 was never taken
    assert batch.pool.n_used == 0 and not batch.running and not batch.seqs and not batch.images
    assert sorted(batch.free_slots) == [0, 1, 2, 3]


def test_a_cancel_before_admission_lets_the_image_go_and_is_idempotent():
    batch = _batch({1: [5, 6, EOS], 2: [7, EOS]})
    img = _image()
    first, second = _seq(1, img), _seq(2, img)
    batch.add_request(first)
    batch.add_request(second)
    batch.cancel(2)
    batch.cancel(2)
    assert second.handle.result().finish_reason == "cancelled" and img.waiting == 1 and img.holders == 1
    assert list(batch.waiting) == [first]
    batch.cancel(1)
    assert first.handle.result().finish_reason == "cancelled"
    assert not batch.waiting and not batch.seqs and not batch.images and img.waiting == 0
    assert batch.pool.n_used == 0 and batch.plan().empty


def test_an_image_let_go_while_its_encoding_is_in_flight_keeps_its_pages_until_the_commit():
    """encode_image, then release() before its step is committed: the step still writes the
    prefix's pages, so they go back (and can be reused) only once it is committed."""
    batch = _batch({})
    img = Image(id=1, crops=None, tiling=(1, 1))  # held by its ImageRef
    batch.add_image(img)
    _step(batch)  # the image alone: encoded ahead of any request
    assert batch.pool.n_used == batch.prefix_pages and img.inflight == 1
    batch.release_ref(img)
    assert batch.pool.n_used == batch.prefix_pages and img.id in batch.images
    batch.check_invariants(depth=2)
    _commit(batch)
    assert batch.pool.n_used == 0 and not batch.images and not batch.pending_images


def test_a_failure_ends_every_request_and_gives_every_page_back():
    batch = _batch({1: [5, 6, 7, 8], 2: [9, 10, 11, 12], 3: [4]}, max_batch=2)
    seqs = [_seq(i, _image(i)) for i in (1, 2, 3)]  # the third waits for a slot
    for s in seqs:
        batch.add_request(s)
    _step(batch)
    _step(batch)  # two steps in flight, then the device fails
    assert batch.pool.n_used > 0 and list(batch.waiting) == [seqs[2]]
    batch.fail()
    assert [s.handle.result().finish_reason for s in seqs] == ["error"] * 3
    assert batch.pool.n_used == 0 and not batch.seqs and not batch.images and not batch.waiting
    assert sorted(batch.free_slots) == [0, 1] and not any(slot.busy for slot in batch.runner.slots)


def test_a_sequence_stops_at_its_capacity_and_at_eos_unless_told_to_ignore_it():
    batch = _batch({1: [5, 6, 7, 8], 2: [5, EOS, 6, 7]})
    capped, ignoring = _seq(1, _image(1), max_tokens=3), _seq(2, _image(2), max_tokens=3, ignore_eos=True)
    batch.add_request(capped)
    batch.add_request(ignoring)
    _run(batch)
    assert batch.steps == 3  # image + prompt with the first token, then two decodes: no extra step
    assert (capped.handle.result().token_ids, capped.handle.result().finish_reason) == ([5, 6, 7], "length")
    assert (ignoring.handle.result().token_ids, ignoring.handle.result().finish_reason) == ([5, EOS, 6], "length")
    assert batch.pool.n_used == 0


def test_the_lower_priority_turn_counts_only_admissions_made_while_it_waited():
    """EngineConfig.lower_turn=3: the oldest lower request goes first after 2 admissions of the
    top priority in a row while it waited; those before it came do not count."""
    batch = _batch({i: [5] * 8 for i in range(1, 6)}, max_batch=8, lower_turn=3)
    img = _image()

    def turn_then_admit(i):
        high = _seq(i, img)
        high.priority = 1
        batch.add_request(high)
        turn = batch.lower_turn()
        step = batch.plan(turn)
        assert step.admit == [high]  # the lower one does not fit anyway
        batch.launch(step)
        _commit(batch)
        return turn

    assert turn_then_admit(1) is None
    assert turn_then_admit(2) is None  # nothing lower waited: no turn counted
    low = _seq(9, img, max_tokens=1000)  # more pages than the pool has: it keeps waiting
    batch.add_request(low)
    assert turn_then_admit(3) is None
    assert turn_then_admit(4) is None
    assert turn_then_admit(5) is low  # two in a row while it waited: its turn


def test_images_encoded_in_one_step_share_its_encoder_time_by_crops():
    batch = _batch({1: [5, EOS], 2: [6, EOS]})
    batch.runner.busy_ms = {"images": 40.0}
    small, large = _image(1), _image(2)
    small.n_crops, large.n_crops = 1, 3
    batch.add_request(_seq(1, small))
    batch.add_request(_seq(2, large))
    _step(batch)
    _commit(batch)
    assert (small.timings.vision, large.timings.vision) == (10.0, 30.0)
