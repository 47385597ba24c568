"""Which rollout messages the trainer has counted, by stream sequence: pure bookkeeping.

A message can come back after it was counted: the trainer crashed between a step's checkpoint
and its acks, or the broker lost its consumer's recent state (kill -9) and offers messages
again. Each is counted once all the same, because the checkpoint keeps the sequences counted:
every one up to `floor` and the few above it (consumption runs roughly in stream order, so the
set above the floor stays small; the broker's ack floor raises it too)."""

from __future__ import annotations


class ConsumedSeqs:
    def __init__(self, floor: int = 0, above: list[int] = ()):
        self.floor = floor
        self.above = {seq for seq in above if seq > floor}

    def __contains__(self, seq: int) -> bool:
        return seq <= self.floor or seq in self.above

    def __len__(self) -> int:
        return self.floor + len(self.above)

    def add(self, seqs: list[int]) -> None:
        self.above.update(seq for seq in seqs if seq > self.floor)
        self._compact()

    def missing_through(self, seq: int) -> int:
        """How many sequences up to `seq` are not counted here."""
        return max(0, seq - self.floor - sum(1 for s in self.above if s <= seq))

    def raise_floor(self, acked_through: int) -> None:
        """Everything up to `acked_through` was acked, so counted (nothing is acked uncounted)."""
        if acked_through > self.floor:
            self.floor = acked_through
            self.above = {seq for seq in self.above if seq > acked_through}
        self._compact()

    def _compact(self) -> None:
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.remove(self.floor)

    def as_dict(self) -> dict:
        return {"floor": self.floor, "above": sorted(self.above)}
