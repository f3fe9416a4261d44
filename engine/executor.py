"""The executor that runs engine steps in launch order on a device (`Executor`), and a launched
step (`Pending`): the engine thread plans and launches the next step while the device runs this
one. On CPU the device is a worker thread; on CUDA, streams and events.
"""

from __future__ import annotations

import _thread
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

import torch


POLL_S = 50e-6  # Pending._watch: how often it looks, and for how long in all
POLL_WINDOW_S = 0.6e-3
WATCH_MAX_S = 0.05  # a longer step: the wake's cost is nothing beside it, and it blocks as before
# CUDA: steps whose timing events wait to be counted into busy_s. stats() counted them, and alone:
# an engine nobody asked (`live` for days) kept two events a step for ever (~17 M a day at 100).
CUDA_TIMED_KEPT = 256


class Pending:
    """A launched step: `wait()` returns its result (or raises its error) once it is done.

    CPU: the done signal is a flag and a bare lock the worker releases between two steps, where
    every Python line it runs keeps the device idle (a threading.Event is a Condition written in
    Python). Releasing the lock costs the worker under 1 us when no thread is blocked on it and
    ~55 us when one is (its wake): hence `_watch`."""

    def __init__(self) -> None:
        self._key: Any = None  # CPU: what it is, for the time it is expected to take
        self._started = 0.0  # CPU: when the worker began it (0: not yet)
        self._expect = 0.0  # CPU: how long the last step of its key took (0: unknown)
        self._finished = False
        self._bell = _thread.allocate_lock()
        self._bell.acquire()  # released once, when the step is done
        self._result: Any = None
        self._error: BaseException | None = None
        self._cuda_event: Any = None
        self._keep: Any = None  # CUDA: the step function, and through it its inputs, until it is done
        self.busy_s = 0.0

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._finished = True
        self._bell.release()

    def done(self) -> bool:
        return self._finished if self._cuda_event is None else bool(self._cuda_event.query())

    def wait(self, timeout: float | None = None, poll: bool = False) -> Any:
        """poll (CPU): the caller has another step queued behind this one, so it may notice this
        one's end a little late without idling the worker (see `_watch`)."""
        if self._cuda_event is not None:
            self._cuda_event.synchronize()  # this step's copies only, never the whole device
            self._keep = None
        elif not self._finished:
            if poll:
                self._watch()
            if not self._finished:
                if not self._bell.acquire(timeout=-1 if timeout is None else timeout):
                    raise TimeoutError("device step did not finish in time")
                self._bell.release()  # for any other waiter, and the next wait
        if self._error is not None:
            raise self._error
        return self._result

    def _watch(self) -> None:
        """Sleep through most of a running step on a timer, then look for its end every POLL_S
        for a while, instead of blocking on its bell: waking a thread blocked on a lock cost the
        worker ~50 us of its time between steps on this project's VMs (a lock released with no
        waiter: under 1 us), ~2.5 % of a decode step of 8 rows. The expected time is that of the
        last step of the same key (its kinds of rows), so a short step after long ones of another
        kind is not slept through. Past the window (a step longer than the last of its key), or
        for a step of unknown or long duration, the caller blocks as usual."""
        started, expect = self._started, self._expect
        if not started or not expect or expect > WATCH_MAX_S:
            return
        now = time.perf_counter()
        nap = started + expect - POLL_WINDOW_S / 2 - now
        if nap > POLL_S:
            time.sleep(nap)
        until = time.perf_counter() + POLL_WINDOW_S
        while not self._finished and time.perf_counter() < until:
            time.sleep(POLL_S)


class Executor:
    """Runs step functions in launch order on one compute stream.

    CPU: one worker thread (torch single-threaded inside) executes the functions FIFO while the
    engine thread goes on with host work. CUDA: the function enqueues its kernels on the compute
    stream from the calling thread and its device-to-host copies on the copy stream; `wait`
    synchronises on that step's own event.
    """

    def __init__(self, device: torch.device, queue_size: int = 4, name: str = "vlmstream-device"):
        self.device = device
        self.busy_s = 0.0
        self._lock = threading.Lock()
        if device.type == "cuda":
            self.compute = torch.cuda.Stream(device)
            self.copy = torch.cuda.Stream(device)
            self._thread = None
            self._cuda_pending: list[tuple[Any, Any]] = []
        else:
            # The worker needs the GIL back between kernels; with Python's default 5 ms switch
            # interval it can wait that long behind host bookkeeping, which undoes pipelining.
            sys.setswitchinterval(min(sys.getswitchinterval(), 1e-4))
            # The jobs: a deque and a bare lock as its bell (released: look again), not a
            # queue.Queue, whose get in Python took ~15 us of the worker's time between steps.
            self._jobs: deque = deque()
            self._queue_size = queue_size
            self._bell = _thread.allocate_lock()
            self._bell.acquire()
            self._stop = threading.Event()
            self._took: dict = {}  # per step key: how long its last step took (Pending._watch)
            self._thread = threading.Thread(target=self._work, name=name, daemon=True)
            self._thread.start()

    def _work(self) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():  # once for the thread: entering it costs Python time between steps
            item = self._next()
            while item is not None:
                fn, pending, on_done = item
                t0 = time.perf_counter()
                pending._expect, pending._started = self._took.get(pending._key, 0.0), t0
                result, error = None, None
                try:
                    result = fn()
                except BaseException as e:  # the engine thread re-raises it at commit
                    error = e
                busy = time.perf_counter() - t0
                if pending._key is not None:
                    if len(self._took) > 512:
                        self._took.clear()
                    self._took[pending._key] = busy
                # The next step is taken before this one is announced: the announcement wakes the
                # engine thread, which then wants the GIL, and the worker should be back in
                # torch (without the GIL) by the time it must give it up.
                item = self._next(wait=False)
                pending.busy_s = busy
                with self._lock:
                    self.busy_s += busy
                pending._finish(result, error)
                if on_done is not None:
                    on_done()
                if item is False:
                    item = self._next()

    def _next(self, wait: bool = True):
        """The next job (None: stop); without `wait`, False when none is queued yet."""
        while True:
            # Read before the queue: the steps launched before close() are queued by the time it
            # sets the flag. Read after, a worker that found the queue empty just before they came
            # and close() followed took the flag for its end: they never ran, their waiters waited.
            stopping = self._stop.is_set()
            try:
                return self._jobs.popleft()
            except IndexError:
                pass
            if not wait:
                return False
            if stopping:
                return None
            self._bell.acquire(timeout=0.1)

    def _ring(self) -> None:
        try:
            self._bell.release()
        except RuntimeError:  # rung already, not yet heard
            pass

    def launch(self, fn: Callable[[], Any], timeout: float = 60.0,
               on_done: Callable[[], None] | None = None, key: Any = None) -> Pending:
        """on_done (CPU): called on the worker once the step is done, e.g. to wake its waiter.
        key (CPU): what kind of step it is (hashable); steps of one key take about as long."""
        pending = Pending()
        pending._key = key
        if self._thread is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Inputs were staged on the caller's stream: order the compute stream after them.
            self.compute.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.compute), torch.inference_mode():
                start.record()
                result = fn()
                end.record()
            pending._cuda_event = self._copy_event(end)
            # The step's inputs were allocated on the caller's stream, and freed memory goes back
            # to that stream's pool: the next step's inputs, copied there while this step still
            # runs on the compute stream, could take it. Keeping the function keeps them alive
            # until the step is done.
            pending._keep = fn
            pending._finish(result)
            with self._lock:  # stats() reads the list from other threads
                self._cuda_pending.append((start, end))
                if len(self._cuda_pending) > CUDA_TIMED_KEPT:
                    self._count_finished()
            return pending
        deadline = time.monotonic() + timeout
        while len(self._jobs) >= self._queue_size:  # bounded; the engine keeps fewer in flight
            if time.monotonic() > deadline:
                raise TimeoutError("device worker is not taking work")
            time.sleep(0.001)
        self._jobs.append((fn, pending, on_done))
        self._ring()
        return pending

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy a step's output to its host buffer. CUDA: on the copy stream, after the step."""
        if self._thread is None:
            self.copy.wait_stream(self.compute)
            with torch.cuda.stream(self.copy):
                dst.copy_(src, non_blocking=True)
            # src belongs to the compute stream's pool: not to be reused before this copy is done.
            src.record_stream(self.copy)
        else:
            dst.copy_(src)

    def _copy_event(self, after: Any) -> Any:
        event = torch.cuda.Event()
        with torch.cuda.stream(self.copy):
            self.copy.wait_event(after)
            event.record(self.copy)
        return event

    def busy_seconds(self) -> float:
        """Time the device spent in step functions (CUDA: measured by events of finished steps)."""
        with self._lock:  # stats() from two threads counted a finished step twice; a launch could be lost
            if self._thread is None:
                self._count_finished()
            return self.busy_s

    def _count_finished(self) -> None:
        """CUDA, with the lock held: the finished steps' times added to busy_s, their events let go."""
        still = []
        for start, end in self._cuda_pending:
            if end.query():
                self.busy_s += start.elapsed_time(end) / 1000.0
            else:
                still.append((start, end))
        self._cuda_pending = still

    def close(self, timeout: float = 10.0, drop_queued: bool = False) -> None:
        """Run the steps launched before (or with `drop_queued`, only the one running: the others
        fail with a RuntimeError) and join the worker, for at most `timeout` seconds."""
        if self._thread is not None and self._thread.is_alive():  # again after it ended: its queue has no reader
            self._stop.set()
            while drop_queued:
                try:
                    job = self._jobs.popleft()  # the worker may take one first: it runs
                except IndexError:
                    break
                if job is None:
                    # A close before this one queued the stop and its join timed out under a step
                    # that outlasted it (the engine thread's close, then Engine.close: Moondream 2's
                    # vision on a CPU takes 5-30 s). The stop stays first: the worker ends on it.
                    self._jobs.appendleft(None)
                    break
                job[1]._finish(None, RuntimeError("the device worker was closed before this step ran"))
            self._jobs.append(None)  # after the jobs queued before it
            self._ring()
            self._thread.join(timeout)
