"""Steps whose loss was nan/inf on any process, counted without waiting on the host.

The step itself is skipped on the device (`Trainer.apply_step`); the count is read only where the loop
syncs anyway (logging, evaluation and checkpoint steps, the last step), by `hooks.NonfiniteHook`, which
stops the run there or counts the skipped steps (--nonfinite_loss).
"""

import torch


class NonfiniteGuard:
    """The non-finite steps since the last read, and the first of them, as device scalars."""

    def __init__(self, device: torch.device, step: int):
        self.step = torch.tensor(step, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # the first bad step since the last read

    def add(self, bad: torch.Tensor) -> None:
        self.step += 1
        self.first = torch.where((self.count == 0) & bad, self.step, self.first)
        self.count += bad

    def read(self) -> tuple[int, int]:
        """(bad steps, the first of them) since the last read; one host sync."""
        count, first = torch.stack([self.count, self.first]).tolist()
        self.count.zero_(), self.first.zero_()
        return count, first
