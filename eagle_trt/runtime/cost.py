"""How many draft tokens a batch verifies per iteration: the choice that maximises expected
tokens per second, from costs and acceptance measured while decoding.

Per iteration of a batch of B sequences that verifies the n best nodes of each tree:
    tokens(n)  = B * accepted(n)          accepted(0) = 1: plain decoding
    seconds(n) = target(B * (1 + n))  +  (draft(B) if n > 0 else 0)
and the decoder verifies argmax_n tokens(n) / seconds(n). Padding is why one n serves the whole
batch: every sequence of a call has 1 + n rows, so a sequence verifying fewer would save nothing.

- target(rows): the running mean time of the decoder's own target calls with that many rows,
  interpolated between measured row counts; beyond them, extended with the slope of a straight
  line fitted (least squares, recent calls weighted more) to every call, prefills included
  (those inform only the line: a prompt's rows see no past, a verification's a long one).
  A table and not only the line: on a CPU one row costs nearly what five do, far more than the
  line through prefills says, and getting exactly that ratio right is the whole decision.
- draft(rows): a straight line fitted the same way, rows = B * (T + K * (D - 1)).
- seconds(n) is replaced by the measured mean time of whole iterations wherever this batch
  size has run with this n: that includes host work, and the catch-up encoding that the first
  drafting iteration after plain ones pays, so flip-flopping between the two costs what it
  really costs. The sum of graph calls above, scaled by the host overhead the measured
  drafting steps of that batch size show, is only the estimate for untried choices.
- Catching the drafter up after plain steps is timed apart, and a choice to draft again pays
  1/16 of it per step: switching back must pay for itself over the next 16 steps.
- accepted(n) is the running mean, over verified trees, of the tokens the verification would
  have accepted had it verified only the n best nodes: the accepted path's leading nodes
  whose score rank is below n, plus the bonus token. A tree verified with n nodes informs
  every n' <= n, so the estimate of a smaller tree is never starved.
Until it has seen `warmup` verifications with the full tree the decoder verifies all N nodes;
the first iteration at a batch size it has not timed plainly decodes plainly (n = 0), so both
ends of the choice are measured, not extrapolated.
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
class CallCosts:
    """Seconds of a graph call by row count: measured means, interpolated, extended by a line."""
    decay: float = 0.7                                   # weight of the previous mean per new call
    means: dict[int, float] = field(default_factory=dict)
    line: LineFit = field(default_factory=LineFit)

    def add(self, rows: int, seconds: float, table: bool = True) -> None:
        """table=False: a call of another kind (a prefill) that only informs the line."""
        self.line.add(rows, seconds)
        if not table:
            return
        old = self.means.get(rows)
        self.means[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    @property
    def seen(self) -> bool:
        return bool(self.means)

    def __call__(self, rows: int) -> float:
        if rows in self.means:
            return self.means[rows]
        below = max((r for r in self.means if r < rows), default=None)
        above = min((r for r in self.means if r > rows), default=None)
        if below is not None and above is not None:
            w = (rows - below) / (above - below)
            return (1 - w) * self.means[below] + w * self.means[above]
        near = below if below is not None else above
        if near is None:
            return self.line(rows)
        slope = max(self.line(near + 1) - self.line(near), 0.0)
        return max(self.means[near] + slope * (rows - near), 0.0)


@dataclass
class CostModel:
    nodes: int                    # N: draft nodes per tree
    draft_rows_per_seq: int       # K * (D - 1): tree-expansion rows the drafter adds per sequence
    warmup: int = 8
    decay: float = 0.98
    target: CallCosts = field(default_factory=CallCosts)
    draft: LineFit = field(default_factory=LineFit)
    accepted: list[float] = field(default_factory=list)   # accepted[n], n = 0..N
    observed: list[float] = field(default_factory=list)   # weight behind accepted[n]
    full_trees: int = 0                                    # verifications of all N nodes so far
    iterations: dict = field(default_factory=dict)         # (batch, n) -> mean seconds of a whole step
    catch_up: LineFit = field(default_factory=LineFit)     # seconds to encode rows skipped by plain steps
    horizon: int = 16                                      # steps a catch-up is paid off over

    def __post_init__(self):
        self.accepted = [1.0] + [0.0] * self.nodes
        self.observed = [1.0] + [0.0] * self.nodes

    def time_target(self, rows: int, seconds: float, prefill: bool = False) -> None:
        self.target.add(rows, seconds, table=not prefill)

    def time_draft(self, batch: int, new_rows: int, seconds: float) -> None:
        self.draft.add(batch * (new_rows + self.draft_rows_per_seq), seconds)

    def time_iteration(self, batch: int, n: int, seconds: float, iteration_decay: float = 0.8) -> None:
        """A whole step (drafting, verification, host work, catching the drafter up) with n nodes."""
        old = self.iterations.get((batch, n))
        self.iterations[batch, n] = seconds if old is None else iteration_decay * old + (1 - iteration_decay) * seconds

    def time_catch_up(self, rows: int, seconds: float) -> None:
        """The drafter encoding rows it skipped while the batch decoded plainly."""
        self.catch_up.add(rows, seconds)

    def _calls(self, batch: int, n: int) -> float:
        if n == 0:
            return self.target(batch)
        return self.target(batch * (1 + n)) + self.draft(batch * (self.accepted[n] + self.draft_rows_per_seq))

    def seconds(self, batch: int, n: int) -> float:
        """A step's time: measured where this (batch, n) ran, else the sum of its graph calls
        scaled by how much longer than their calls the measured drafting steps of this batch
        size took (host work)."""
        if (batch, n) in self.iterations:
            return self.iterations[batch, n]
        ran = [m for m in range(1, self.nodes + 1) if (batch, m) in self.iterations]
        scale = sum(self.iterations[batch, m] / max(self._calls(batch, m), 1e-9) for m in ran) / len(ran) if ran else 1.0
        return self._calls(batch, n) * (scale if n else 1.0)

    def observe(self, path_ranks: list[int], verified: int) -> None:
        """One verified tree: the score ranks (0 = best) of the accepted draft nodes, root to
        leaf, and how many nodes were verified."""
        self.full_trees += verified == self.nodes
        for n in range(1, verified + 1):
            accepted = 1
            for rank in path_ranks:
                if rank >= n:
                    break
                accepted += 1
            self.observed[n] = self.observed[n] * self.decay + 1.0
            self.accepted[n] += (accepted - self.accepted[n]) / self.observed[n]

    def choose(self, batch: int, backlog: int = 0) -> int:
        """Draft nodes to verify per sequence this iteration (0 = plain decoding). backlog: rows
        the drafter must catch up on before it can draft (after plain steps); that one-time cost
        is spread over `horizon` steps, so the decoder does not flip back and forth."""
        if self.full_trees < self.warmup or not (self.target.seen and self.draft.seen):
            return self.nodes
        if (batch, 0) not in self.iterations:   # time plain decoding at this batch size once
            return 0
        extra = self.catch_up(backlog) / self.horizon if backlog and self.catch_up.seen else 0.0
        rates = [batch * self.accepted[n] / max(self.seconds(batch, n) + (extra if n else 0.0), 1e-9)
                 for n in range(self.nodes + 1)]
        return max(range(self.nodes + 1), key=lambda n: (rates[n], -n))
