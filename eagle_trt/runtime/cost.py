"""How many draft tokens a batch verifies per iteration: the choice that maximises expected
tokens per second, from costs and acceptance measured while decoding.

Per iteration of a batch of B sequences that verifies the n best nodes of each tree:
    tokens(n)  = B * accepted(n)          accepted(0) = 1: plain decoding
    seconds(n) = target(B * (1 + n))  +  (draft(B) if n > 0 else 0)
and the decoder verifies argmax_n tokens(n) / seconds(n). Padding is why one n serves the whole
batch: every sequence of a call has 1 + n rows, so a sequence verifying fewer would save nothing.

- target(rows) and draft(rows) are straight lines (fixed cost + cost per row) fitted by
  least squares to the decoder's own timed calls, recent calls weighted more; prefills give
  the long-row points, verifications the short ones. draft rows = B * (T + K * (D - 1)).
- accepted(n) is the running mean, over verified trees, of the tokens the verification would
  have accepted had it verified only the n best nodes: the accepted path's leading nodes
  whose score rank is below n, plus the bonus token. A tree verified with n nodes informs
  every n' <= n, so the estimate of a smaller tree is never starved.
Until it has seen `warmup` verifications with the full tree the decoder verifies all N nodes.
When the batch grows until verification is compute-bound (a CPU at a few sequences), n = 0
wins: the decoder stops drafting and decodes plainly, and drafts again when the batch shrinks
(the drafter then catches up on the rows it skipped in one call)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LineFit:
    """y = a + b * x by exponentially weighted least squares."""
    decay: float = 0.97
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)   # w, wx, wy, wxx, wxy

    def add(self, x: float, y: float) -> None:
        self.sums = [s * self.decay + t for s, t in zip(self.sums, (1.0, x, y, x * x, x * y))]

    @property
    def seen(self) -> bool:
        return self.sums[0] > 0

    def __call__(self, x: float) -> float:
        w, sx, sy, sxx, sxy = self.sums
        if w == 0:
            return 0.0
        spread = w * sxx - sx * sx
        slope = (w * sxy - sx * sy) / spread if spread > 1e-9 * max(w * sxx, 1e-30) else sy / max(sx, 1e-30)
        slope = max(slope, 0.0)
        fixed = max((sy - slope * sx) / w, 0.0)
        return fixed + slope * x


@dataclass
class CostModel:
    nodes: int                    # N: draft nodes per tree
    draft_rows_per_seq: int       # K * (D - 1): tree-expansion rows the drafter adds per sequence
    warmup: int = 8
    decay: float = 0.98
    target: LineFit = field(default_factory=LineFit)
    draft: LineFit = field(default_factory=LineFit)
    accepted: list[float] = field(default_factory=list)   # accepted[n], n = 0..N
    observed: list[float] = field(default_factory=list)   # weight behind accepted[n]

    def __post_init__(self):
        self.accepted = [1.0] + [0.0] * self.nodes
        self.observed = [1.0] + [0.0] * self.nodes

    def time_target(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)

    def time_draft(self, batch: int, new_rows: int, seconds: float) -> None:
        self.draft.add(batch * (new_rows + self.draft_rows_per_seq), seconds)

    def observe(self, path_ranks: list[int], verified: int) -> None:
        """One verified tree: the score ranks (0 = best) of the accepted draft nodes, root to
        leaf, and how many nodes were verified."""
        for n in range(1, verified + 1):
            accepted = 1
            for rank in path_ranks:
                if rank >= n:
                    break
                accepted += 1
            self.observed[n] = self.observed[n] * self.decay + 1.0
            self.accepted[n] += (accepted - self.accepted[n]) / self.observed[n]

    def choose(self, batch: int) -> int:
        """Draft nodes to verify per sequence this iteration (0 = plain decoding)."""
        if self.observed[self.nodes] < self.warmup or not (self.target.seen and self.draft.seen):
            return self.nodes
        best, best_rate = 0, batch / max(self.target(batch), 1e-9)
        for n in range(1, self.nodes + 1):
            seconds = self.target(batch * (1 + n)) + self.draft(batch * (self.accepted[n] + self.draft_rows_per_seq))
            rate = batch * self.accepted[n] / max(seconds, 1e-9)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def summary(self, batch: int) -> dict:
        return {"target_ms_per_call": {rows: round(1e3 * self.target(rows), 2) for rows in (batch, batch * (1 + self.nodes))},
                "draft_ms_per_call": round(1e3 * self.draft(batch * (1 + self.draft_rows_per_seq)), 2),
                "accepted": [round(a, 3) for a in self.accepted], "choice": self.choose(batch)}
