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
- seconds(n) is replaced by the measured time of whole iterations wherever this batch size
  has run with this n (the median of its last 9 steps, its very first not counted); that
  includes host work (not catching up, timed apart). For untried choices it is the sum of
  graph calls above, scaled by the host overhead the measured drafting steps of that batch
  size show (of every batch size, while it has none).
- Catching the drafter up after plain steps (or on a new prompt) is timed apart, and a choice to
  draft pays it off over the steps the sequence has left (its remaining max_new_tokens over
  accepted(n), at most `horizon`): a catch-up is a one-time price for drafting for the rest of
  the sequence, so a long backlog does not lock a sequence into plain decoding for its life.
- accepted(n) = 1 + gain(1) + ... + gain(n), where gain(m) is the running mean, over trees
  verified with at least m nodes, of how many more tokens verifying the m best nodes accepts
  than verifying the m - 1 best (the accepted path's leading nodes whose highest score rank so
  far is m - 1). Gains, not levels: a level kept per n would mix different trees (the full
  tree's only from warm-up, the smaller ones from later) and could fall as n grows.
- Drafting must beat plain decoding by `margin` (2%) in expected tokens per second to go on,
  and by `switch_margin` (5%) to start after plain steps: estimates are noisy, a switch pays
  a catch-up, and plain decoding is exactly what the batch would get without a drafter, so a
  near tie goes to it.
- Measured means go stale for choices no longer made, and one slow step (a shape's first run,
  a busy machine) would otherwise rule a choice out for good. So while drafting, a batch size
  re-times plain decoding for `plain_burst` (3) steps every `explore_every` (32) and verifies
  the full tree every 32 drafting steps (which also keeps the larger trees' gains current).
  Where drafting leads plain decoding by `clear_lead` (20%) or more, each re-timing of plain
  decoding doubles the wait before the next, up to `plain_backoff_max` (8) periods: a stale plain
  time cannot flip such a choice, and at one stream on a CPU (drafting ~1.45x plain) re-timing
  every 32 steps spent ~9% of the steps decoding plainly. A narrower lead resets the wait.
  While decoding plainly, it drafts full trees for `burst` (8) steps if drafting's estimated
  rate (its catch-up included) is within `retry` (85%) of plain decoding's: 128 steps after the
  decoder last drafted (at any batch size: a batch shrinking as requests finish is not retried
  at every size), then twice as long after each retry that does not win (up to 1024 steps:
  every retry pays a catch-up). A retry re-learns acceptance: the trees before it weigh as much
  as `burst` trees, since they are from the sequences that made drafting stop.
With an iteration graph (drafting and verification in one call), every drafting step after
the warm-up is one call, whatever n it verifies: only its whole time is measured (seconds(n) is
that median), and the call tables keep the two-call timings of the warm-up (and every step's,
with a graph composed before iteration format 3, which verifies whole trees only).
Until it has seen `warmup` verifications with the full tree the decoder verifies all N nodes;
the first iteration at a batch size it has not timed plainly decodes plainly (n = 0), so both
ends of the choice are measured, not extrapolated.
When the batch grows until verification is compute-bound (a CPU at a few sequences), n = 0
wins: the decoder stops drafting and decodes plainly, and drafts again when the batch shrinks
(the drafter then catches up on the rows it skipped in one call)."""
from __future__ import annotations

import statistics
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
    warmup: int = 32
    decay: float = 0.99
    margin: float = 0.02                                   # drafting must beat plain decoding by this much
    explore_every: int = 32                                # while drafting, verify the full tree this often
    horizon: int = 64                                      # most steps a catch-up is paid off over
    target: CallCosts = field(default_factory=CallCosts)
    draft: LineFit = field(default_factory=LineFit)
    gains: list[float] = field(default_factory=list)      # gains[m]: accepted(m) - accepted(m - 1), m = 1..N
    observed: list[float] = field(default_factory=list)   # weight behind gains[m]
    full_trees: int = 0                                    # verifications of all N nodes so far
    since_full: int = 0                                    # drafting steps since the last full tree
    samples: dict = field(default_factory=dict)            # (batch, n) -> its last `recent` step times
    iterations: dict = field(default_factory=dict)         # (batch, n) -> their median, once there is one
    recent: int = 9
    clock: int = 0                                         # choices made
    last_run: dict = field(default_factory=dict)           # (batch, n) -> clock when last chosen
    retry: float = 0.85                                    # plain: re-time drafting if within this of it
    backoff: int = 4                                       # explore_every periods from drafting to a retry
    last_drafted: int = 0                                  # clock of the last step that drafted (any batch)
    burst: int = 8                                         # full-tree steps per retry
    plain_burst: int = 3                                   # plain steps per re-timing while drafting
    clear_lead: float = 0.2                                # drafting this much faster: re-time plain less often
    plain_backoff: dict = field(default_factory=dict)      # batch -> explore_every periods between re-timings
    plain_backoff_max: int = 8
    switch_margin: float = 0.05                            # plain -> drafting needs this much more
    drafting: dict = field(default_factory=dict)           # batch -> whether the last choice drafted
    trial: dict = field(default_factory=dict)              # batch -> (n, steps still to run) of a re-timing
    catch_up: LineFit = field(default_factory=LineFit)     # seconds to encode rows skipped by plain steps

    def __post_init__(self):
        self.gains = [0.0] * (self.nodes + 1)
        self.observed = [0.0] * (self.nodes + 1)

    @property
    def accepted(self) -> list[float]:
        """accepted[n]: expected tokens per sequence from verifying the n best nodes (n = 0: 1)."""
        out = [1.0]
        for g in self.gains[1:]:
            out.append(out[-1] + g)
        return out

    def time_target(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds)

    def time_prefill(self, rows: int, seconds: float) -> None:
        self.target.add(rows, seconds, table=False)       # informs the line only: it has no past

    def time_draft(self, batch: int, new_rows: int, seconds: float) -> None:
        self.draft.add(batch * (new_rows + self.draft_rows_per_seq), seconds)

    def time_iteration(self, batch: int, n: int, seconds: float) -> None:
        """A whole step (drafting, verification, host work; not catching up) with n nodes. Its
        mean is the median of the last `recent` steps: the first step after a switch of call
        shape runs slow (buffers re-planned), and a mean would carry that into the choice. The
        first step of a (batch, n) is not used at all: one-time allocations."""
        key = batch, n
        if key not in self.samples:
            self.samples[key] = []
            return
        kept = self.samples[key]
        kept.append(seconds)
        del kept[:-self.recent]
        self.iterations[key] = statistics.median(kept)

    def time_catch_up(self, rows: int, seconds: float) -> None:
        """The drafter encoding rows it skipped while the batch decoded plainly."""
        self.catch_up.add(rows, seconds)

    def _calls(self, batch: int, n: int, accepted: list[float]) -> float:
        if n == 0:
            return self.target(batch)
        return self.target(batch * (1 + n)) + self.draft(batch * (accepted[n] + self.draft_rows_per_seq))

    def seconds(self, batch: int, n: int, accepted: list[float] | None = None, scale: float | None = None) -> float:
        """A step's time: measured where this (batch, n) ran, else the sum of its graph calls
        scaled by how much longer than their calls the measured drafting steps of this batch
        size took (host work). accepted / scale: what `choose` computed once for every n."""
        if (batch, n) in self.iterations:
            return self.iterations[batch, n]
        accepted = accepted or self.accepted
        if n and scale is None:
            scale = self._host_scale(batch, accepted)
        return self._calls(batch, n, accepted) * (scale if n else 1.0)

    def _host_scale(self, batch: int, accepted: list[float]) -> float:
        ran = [(b, m) for b, m in self.iterations if m > 0 and b == batch]
        ran = ran or [(b, m) for b, m in self.iterations if m > 0]   # no drafting at this size yet: any size's
        return (sum(self.iterations[k] / max(self._calls(*k, accepted), 1e-9) for k in ran) / len(ran)
                if ran else 1.0)

    def observe(self, path_ranks: list[int], verified: int) -> None:
        """One verified tree: the score ranks (0 = best) of the accepted draft nodes, root to
        leaf, and how many nodes were verified."""
        self.full_trees += verified == self.nodes
        self.since_full = 0 if verified == self.nodes else self.since_full + 1
        gained = [0] * (self.nodes + 1)
        highest = -1
        for rank in path_ranks:   # a node counts from n = (highest rank on its path so far) + 1 on
            highest = max(highest, rank)
            gained[highest + 1] += 1
        for m in range(1, verified + 1):
            self.observed[m] = self.observed[m] * self.decay + 1.0
            self.gains[m] += (gained[m] - self.gains[m]) / self.observed[m]

    @property
    def warming_up(self) -> bool:
        """Still timing the drafter and target calls of whole trees apart (a decoder with an
        iteration graph makes those two calls until then: one call of both cannot be split)."""
        return self.full_trees < self.warmup or not (self.target.seen and self.draft.seen)

    def choose(self, batch: int, backlog: int = 0, remaining: int | None = None) -> int:
        """Draft nodes to verify per sequence this iteration (0 = plain decoding). backlog: rows
        the drafter must catch up on before it can draft (a new prompt, plain steps); that
        one-time cost is paid off over the steps left (remaining: tokens the sequences with a
        backlog may still generate, on average), at most `horizon`."""
        if self.warming_up:
            return self.nodes
        if (batch, 0) not in self.samples:   # time plain decoding at this batch size once
            return 0
        accepted = self.accepted
        catch_up = self.catch_up(backlog) if backlog and self.catch_up.seen else 0.0
        scale = None if all((batch, n) in self.iterations for n in range(1, self.nodes + 1)) \
            else self._host_scale(batch, accepted)      # needed only for the n not measured at this batch

        def rate(n: int) -> float:
            seconds = self.seconds(batch, n, accepted, scale)
            if n and catch_up:
                steps = min(self.horizon, (remaining if remaining is not None else self.horizon) / accepted[n])
                seconds += catch_up / max(steps, 1.0)
            return batch * accepted[n] / max(seconds, 1e-9)
        rates = [rate(n) for n in range(self.nodes + 1)]
        best = max(range(1, self.nodes + 1), key=lambda n: (rates[n], -n))
        # hysteresis: plain decoding switches to drafting only for a clear gain (a switch pays a
        # catch-up, and the estimate that drafting pays comes from stale or few trees)
        need = self.margin if self.drafting.get(batch) else self.switch_margin
        pick = best if rates[best] > rates[0] * (1 + need) else 0
        clear = rates[best] > rates[0] * (1 + self.clear_lead)
        if not clear:
            self.plain_backoff[batch] = 1
        self.drafting[batch] = pick > 0
        if pick:
            self.backoff = 4
        self.clock += 1
        retiming, left = self.trial.get(batch, (0, 0))
        if left:                                       # a re-timing in progress
            self.trial[batch] = retiming, left - 1
            pick = retiming
        elif pick and self._stale(batch, 0, self.plain_backoff.get(batch, 1)):   # re-time plain decoding
            self.trial[batch] = 0, self.plain_burst - 1
            if clear:       # the next re-timing waits twice as long
                self.plain_backoff[batch] = min(2 * self.plain_backoff.get(batch, 1), self.plain_backoff_max)
            pick = 0
        elif pick and self.since_full >= self.explore_every:
            pick = self.nodes
        elif (not pick and rates[self.nodes] >= self.retry * rates[0]
              and self.clock - self.last_drafted >= self.backoff * self.explore_every):
            self.trial[batch] = self.nodes, self.burst - 1   # drafting nearly pays: re-time it for a few steps
            # and re-learn acceptance: the trees before weigh as much as `burst` trees (they are
            # from the sequences that made drafting stop, and the batch has moved on since)
            self.observed = [min(w, self.burst) for w in self.observed]
            self.backoff = min(2 * self.backoff, 32)     # each retry that does not win waits longer
            pick = self.nodes
        self.last_run[batch, pick] = self.clock
        if pick:
            self.last_drafted = self.clock
        return pick

    def _stale(self, batch: int, n: int, periods: int) -> bool:
        return self.clock - self.last_run.get((batch, n), 0) >= periods * self.explore_every
