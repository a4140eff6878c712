"""A data loader that reads the next steps' micro-batches on a background thread.

The loop then finds each step's batches ready (data wait near zero) while the thread reads
and stacks the following ones; on CUDA they are pinned, so the copy to the device can be
asynchronous. Reading is memory-mapped numpy work that releases the GIL for its copies, so
one thread is enough to stay far ahead of the model.

The position stays exact: `state_dict()` is the next step the loop will consume, never what
the thread has read ahead, so a checkpoint taken between steps resumes on the same batches.
"""

from __future__ import annotations

import queue
import threading

import torch

from pretrain.trainer.data.loader import DataLoader

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class PrefetchingLoader:
    """`DataLoader` with the same interface, reading up to `depth` steps ahead on a thread."""

    def __init__(self, loader: DataLoader, depth: int = 2, pin_memory: bool = False) -> None:
        """Prefetch from `loader` (at its current position); `pin_memory` on CUDA hosts."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.loader = loader
        self.depth = depth
        self.pin_memory = pin_memory
        self._next = loader.step
        self._start()

    @property
    def step(self) -> int:
        """The next step `next_step` returns."""
        return self._next

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._read, args=(self._queue, self._stop), name="prefetch", daemon=True
        )
        self._thread.start()

    def _read(self, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            step = self.loader.step
            try:
                batches = self.loader.next_step()
                if self.pin_memory:
                    batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
                item: tuple = (step, batches, None)
            except Exception as error:  # handed to the loop, which raises it
                item = (step, None, error)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def next_step(self) -> Batches:
        """(inputs, targets) per accumulation micro-batch of the next step; advances by one."""
        step, batches, error = self._queue.get()
        if error is not None:
            raise RuntimeError(f"reading the micro-batches of step {step} failed") from error
        assert step == self._next, f"prefetched step {step}, expected {self._next}"
        self._next += 1
        return batches

    def state_dict(self) -> dict[str, int]:
        """The position (the next step the loop consumes) and what it is valid for."""
        return {**self.loader.state_dict(), "step": self._next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position: drop what was read ahead and read from there."""
        self.close()
        self.loader.load_state_dict(state)
        self._next = self.loader.step
        self._start()

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; the position stays where it is."""
        self._stop.set()
        self._thread.join()
        self.loader.step = self._next
