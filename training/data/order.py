"""The order in which an epoch visits a dataset, and each rank's rows of it: pure
functions of (seed, epoch), the dataset's layout and the shares, so that

- every world size and every split of the batch sees the same global batches (batch s
  of epoch e is the same set of rows whether one rank or five read it);
- a restarted world resumes at any global step with no reader state to restore.

Map-style datasets (random access) are visited in one permutation of all their rows
(`map_permutation`, the order training.dist.ShareSampler uses too); rank r takes rows
[lo_r, hi_r) of each global batch.

Parquet datasets are read in blocks (row groups, or row ranges of a big one). An
epoch's order (with `B` the global batch):

1. the blocks are permuted, and their rows laid out in that order (positions 0..n-1);
2. the positions are cut into windows of K*B rows (K whole batches, about
   `window_bytes` of data; the last window may be shorter, the last batch partial);
3. a window's positions are cut into B strata of K consecutive positions, and each
   stratum's K rows are dealt to the window's K batches in a random order: batch j of
   the window holds one random row of every stratum (a stratified shuffle: every batch
   spans the whole window, and the rows of a block are spread over all its batches).

Global batch s is the s-th batch of the epoch. Rank r takes rows [lo_r, hi_r) of it in
position order, that is the rows of strata lo_r..hi_r-1: the same contiguous range of
every window. So the batch, hence the update, is the same set of rows however it is
split, while a rank reads only its share of each window's blocks (plus the blocks cut
by a rank or window boundary): read amplification about 1 + ranks / (blocks per window)
instead of the world size. The price: a rank's rows of a batch come from its range of
the window, so statistics computed per rank (BatchNorm's batch statistics) see a less
mixed sample if the data was written in a meaningful order (sorted by class, say).
yarnapp's importers write shuffled rows; see docs/data.md.
"""
import dataclasses
import hashlib
import itertools

import numpy as np


def split_rows(total, weights):
    """Integers n_r >= 0 with sum n_r = total and n_r ~ total * w_r / sum(w).

    Largest remainder: floors first, then one more row to the largest remainders
    (ties to the lower rank). Deterministic, so every rank computes the same split.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(w > 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"shares must be positive finite weights, got {list(weights)}")
    exact = total * w / w.sum()
    rows = np.floor(exact).astype(np.int64)
    left = int(total - rows.sum())
    order = sorted(range(len(w)), key=lambda r: (-(exact[r] - rows[r]), r))
    for r in order[:left]:
        rows[r] += 1
    return [int(n) for n in rows]


def given_weights(shares, vcores):
    """One weight per rank for `training.shares` where nothing has to be measured: a list
    as given, "equal", or "vcores" (`vcores`: each rank's container's, in rank order);
    None for "speed", whose weights the ranks measure at start. The one rule behind every
    strategy's shares, training.dist's, the planner's and submit's preflight. ValueError,
    naming training.shares, for any other value or a list not of one weight per rank."""
    n = len(vcores)
    if isinstance(shares, (list, tuple)):
        if len(shares) != n:
            raise ValueError(f"training.shares: {len(shares)} shares given for {n} ranks; give one per rank")
        return [float(s) for s in shares]
    if shares == "equal":
        return [1.0] * n
    if shares == "vcores":
        return [float(v) for v in vcores]
    if shares == "speed":
        return None
    raise ValueError(f"training.shares: expected 'equal', 'vcores', 'speed' or a list of weights, got {shares!r}")


def map_permutation(n, seed, epoch):
    """The order in which `epoch` visits the n rows of a map-style dataset: numpy's PCG64
    seeded with SeedSequence([seed, epoch]), the same on every rank. Ranks of one world
    must share a numpy version."""
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) % 2 ** 64, int(epoch)]))
    return rng.permutation(n)


def steps_per_epoch(n, global_batch, drop_last):
    return n // global_batch if drop_last else -(-n // global_batch)


def slice_of(lo, hi, size, global_batch):
    """This rank's [lo, hi) of a batch of `size` rows (the last one may be short): scaled
    pro rata, so the slices of all ranks still tile it exactly (a slice may be empty)."""
    if size == global_batch:
        return lo, hi
    return lo * size // global_batch, hi * size // global_batch


@dataclasses.dataclass
class Plan:
    """One rank's rows of one epoch: step i (0-based in the epoch) is rows[ptr[i]:ptr[i+1]]
    (global row ids, in position order). They lie in runs of one block each: run k is
    rows[run_at[k]:run_at[k+1]], of block run_block[k], and step i's runs are
    run_ptr[i]:run_ptr[i+1] (map-style data has no blocks: run_block None). Its memory
    is the rank's rows (4 bytes each below 2**31 rows, else 8) and its runs."""
    epoch: int
    ptr: np.ndarray
    rows: np.ndarray
    run_at: np.ndarray = None
    run_block: np.ndarray = None
    run_ptr: np.ndarray = None
    index: dict = dataclasses.field(default=None, repr=False)     # Schedule's per-block view

    @property
    def steps(self):
        return len(self.ptr) - 1

    def step(self, i):
        """(global row ids, block ids) of step i (block -1 for map-style data)."""
        a, b = self.ptr[i], self.ptr[i + 1]
        if self.run_block is None:
            return self.rows[a:b], np.full(b - a, -1, dtype=np.int64)
        r0, r1 = self.run_ptr[i], self.run_ptr[i + 1]
        return self.rows[a:b], np.repeat(self.run_block[r0:r1], np.diff(self.run_at[r0:r1 + 1]))

    def step_blocks(self, i):
        """The distinct blocks step i reads, in block order."""
        if self.run_block is None:
            return ()
        return tuple(sorted(self.run_block[self.run_ptr[i]:self.run_ptr[i + 1]].tolist()))

    @property
    def blocks(self):
        """Every row's block id (a copy: tests and tools; the reader walks the runs)."""
        return np.concatenate([self.step(i)[1] for i in range(self.steps)]) if self.steps else np.zeros(0, np.int64)


class Order:
    """The epoch orders of a dataset of `block_rows[k]` rows in block k (file order).

    block_bytes: each block's size, for cutting windows (default: rows). window_bytes:
    the shuffle window (None or 0: one window, a full shuffle). map_style: one
    permutation of all rows (`map_permutation`), slices not put in block order.
    """

    def __init__(self, block_rows, block_bytes=None, window_bytes=None, map_style=False, content=None):
        self.block_rows = np.asarray(block_rows, dtype=np.int64)
        self.block_bytes = np.asarray(block_bytes if block_bytes is not None else block_rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.block_rows)])
        self.n = int(self.starts[-1])
        self.window_bytes = int(window_bytes or 0)
        self.map_style = bool(map_style)
        self.content = np.asarray(content if content is not None else [], dtype="<i8")     # for fingerprint

    def fingerprint(self, global_batch):
        """What places a row in an epoch besides the seed, digested: the blocks' rows in file
        order, what their footers tell of their content (`content`: each block's compressed
        bytes; the same rows rewritten shuffled compress otherwise) and the window's rows at
        this batch. Another shuffle_window, or the rows rewritten in other row groups, is
        another order: a checkpoint's step mid-epoch stands for other rows
        (training.checkpoint.other_data)."""
        h = hashlib.sha1(b"map" if self.map_style else b"blocks")
        h.update(self.block_rows.astype("<i8").tobytes())
        h.update(self.content.tobytes())
        h.update(str(self.window_rows(global_batch)).encode())
        return h.hexdigest()[:12]

    def window_rows(self, global_batch):
        """Rows per window: whole batches, about window_bytes of blocks, at least one batch
        (None: one window for the whole epoch)."""
        if not self.window_bytes:
            return None
        row_bytes = max(1.0, float(self.block_bytes.sum()) / max(1, self.n))
        return max(1, int(round(self.window_bytes / row_bytes / global_batch))) * global_batch

    EXACT_ROWS = 1_000_000      # largest_step_bytes plays the real plan up to this many rows (~0.25 s)

    def largest_step_bytes(self, global_batch, rows, seed=0):
        """The most bytes of blocks one step of a rank reading `rows` of each global batch
        reads at once (what its reader must hold, whatever its budget): from epoch 0's
        real plan of the first `rows` of each batch up to EXACT_ROWS rows, else
        step_bytes' estimate."""
        B, rows = int(global_batch), int(rows)
        if rows <= 0 or self.n < B:
            return 0
        if self.n > self.EXACT_ROWS or self.map_style:
            return self.step_bytes(B, rows)
        blocks, steps = _block_steps(self.plan(seed, 0, B, 0, rows))
        return int(np.bincount(steps, weights=self.block_bytes[blocks]).max())

    def step_bytes(self, global_batch, rows):
        """An estimate of largest_step_bytes: a step takes one row of each of `rows` strata
        of K consecutive positions, so it touches a block per row where a stratum spans a
        block or more, else the blocks under its strata and one at each end; blocks
        weighed by their rows, as a random row falls in them. Within 0.75-1.25 of the real
        plan for steps of 8 blocks or more, up to 2x over for steps of a block or two."""
        B, rows = int(global_batch), int(rows)
        if rows <= 0 or self.n < B:
            return 0
        K = max(1, min(self.window_rows(B) or self.n, self.n) // B)
        row, block = self._row_and_block()
        return int(min(min(rows, rows * K * row / block + 2) * block, self.block_bytes.sum()))

    def _row_and_block(self):
        """(bytes a row, bytes of the block a random row falls in: blocks weighed by size)."""
        return (float(self.block_bytes.sum()) / self.n,
                float((self.block_bytes.astype(np.float64) ** 2).sum() / self.block_bytes.sum()))

    def window_within(self, global_batch, rows, nbytes):
        """The largest shuffle window (bytes, whole batches) whose steps of `rows` rows
        step_bytes keeps within `nbytes`; 0 where even a window of one batch does not."""
        row, block = self._row_and_block()
        batches = int((nbytes - 2 * block) // (rows * row)) if nbytes > 2 * block else 0
        return int(batches * int(global_batch) * row) if batches >= 1 else 0

    @property
    def row_dtype(self):
        """The dtype a Plan keeps row ids in: int32 below 2**31 rows, else int64."""
        return np.int32 if self.n < 2 ** 31 else np.int64

    def plan_bytes(self, global_batch, rows):
        """About the bytes a Schedule of a rank reading `rows` of each global batch holds:
        Schedule.KEEP epochs of its rows (4 bytes each below 2**31 rows, else 8) and of
        their runs of one block (~16 bytes each with the index: a run per block a step
        touches, as step_bytes counts them), and plan's temporaries while one is made."""
        B, rows = int(global_batch), int(rows)
        if rows <= 0 or self.n < B:
            return 0
        K = max(1, min(self.window_rows(B) or self.n, self.n) // B)
        row, block = self._row_and_block()
        runs_per_row = min(rows, rows * K * row / block + 2) / rows
        itemsize = np.dtype(self.row_dtype).itemsize
        return int(Schedule.KEEP * self.n * rows / B * (itemsize + 16 * runs_per_row)) + 48 * self.CHUNK

    def positions(self, seed, epoch, global_batch, shuffle=True):
        """(u, perm, cum): the epoch's sequence u of positions in the row space laid out in
        block order perm (cum[j] = rows before the j-th block of perm)."""
        k, n, B = len(self.block_rows), self.n, int(global_batch)
        if not shuffle:
            return np.arange(n), np.arange(k), self.starts
        if self.map_style:
            return map_permutation(n, seed, epoch), np.arange(k), self.starts
        rng = np.random.default_rng(np.random.SeedSequence([int(seed) % 2 ** 64, int(epoch), 2]))
        perm = rng.permutation(k)
        cum = np.concatenate([[0], np.cumsum(self.block_rows[perm])])
        u = np.empty(n, dtype=np.int64)
        window = self.window_rows(B) or max(B, n // B * B)
        a = 0
        while a < n:
            K = min(window, n - a) // B
            if K == 0:                                  # the last, partial batch
                u[a:] = a + rng.permutation(n - a)
                break
            deal = rng.permuted(np.tile(np.arange(K), (B, 1)), axis=1)       # stratum i -> batch order
            u[a:a + K * B] = (a + np.arange(B)[None, :] * K + deal.T).reshape(-1)
            a += K * B
        return u, perm, cum

    def to_rows(self, u, perm, cum):
        """(global row ids, block ids) of positions u."""
        j = np.searchsorted(cum, u, side="right") - 1
        blocks = perm[j]
        return self.starts[blocks] + (u - cum[j]), blocks

    def epoch_rows(self, seed, epoch, global_batch, shuffle=True):
        """The global row ids of the epoch, in order."""
        return self.to_rows(*self.positions(seed, epoch, global_batch, shuffle))[0]

    CHUNK = 1 << 18     # positions made or turned into rows at a time (plan's temporaries: ~40 bytes each)

    def plan(self, seed, epoch, global_batch, lo, hi, drop_last=True, shuffle=True):
        """This rank's Plan of `epoch`: slice [lo, hi) of every global batch (the rows of
        `positions` there, each batch's in position order). Made window by window from
        the same random draws, so that its memory is that of the rank's own rows: the
        whole epoch's positions took ~40 bytes a row of the dataset at once (16M rows of
        small images: 0.7 GiB, and the kernel killed 1 GiB containers at step 0)."""
        B, lo, hi = int(global_batch), int(lo), int(hi)
        full, rest = divmod(self.n, B)
        partial = bool(rest) and not drop_last
        a, b = slice_of(lo, hi, rest, B) if partial else (0, 0)
        counts = np.append(np.full(full, hi - lo, dtype=np.int64), [b - a] if partial else [])
        ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.map_style:
            u = self.positions(seed, epoch, B, shuffle)[0]
            mine = np.concatenate([u[:full * B].reshape(full, B)[:, lo:hi].reshape(-1), u[full * B:][a:b]])
            return Plan(epoch, ptr, mine)
        perm, cum, parts = self._positions_of(seed, epoch, B, lo, hi, shuffle)
        tail = np.arange(full * B + a, full * B + b, dtype=np.int64)  # the partial batch, in position order
        rows = np.empty(int(ptr[-1]), dtype=self.row_dtype)
        firsts = ptr[:-1][counts > 0]               # where the steps with rows start: each starts a run
        run_at, run_block, at, last = [], [], 0, -1
        for part in itertools.chain(parts, [tail]):
            for c in range(0, len(part), self.CHUNK):
                u = part[c:c + self.CHUNK]
                j = np.searchsorted(cum, u, side="right") - 1
                block = perm[j]
                rows[at:at + len(u)] = self.starts[block] + (u - cum[j])
                cut = np.empty(len(u), dtype=bool)     # a new run where the block changes, or a step starts
                cut[0] = block[0] != last
                np.not_equal(block[1:], block[:-1], out=cut[1:])
                cut[firsts[np.searchsorted(firsts, at):np.searchsorted(firsts, at + len(u))] - at] = True
                new = np.flatnonzero(cut)
                run_at.append(new + at)
                run_block.append(block[new].astype(np.int32))
                at, last = at + len(u), block[-1]
        run_at = np.concatenate(run_at + [[len(rows)]]).astype(rows.dtype)
        run_block = np.concatenate(run_block) if run_block else np.zeros(0, np.int32)
        return Plan(epoch, ptr, rows, run_at, run_block, np.searchsorted(run_at[:-1], ptr).astype(np.int64))

    def _positions_of(self, seed, epoch, B, lo, hi, shuffle):
        """(perm, cum, parts): the block order and its offsets as `positions` lays them
        out, and this rank's positions of the epoch's whole batches, in pieces of about
        CHUNK (a generator): batch j of a window holds one position of each of its B strata
        of K (stratum i: a + i*K + deal[i, j]), so its strata lo..hi-1 are its rows here,
        in position order. The deal is drawn as `positions` draws it, in pieces: several
        windows at once where they are small (a window of one batch each, large images),
        strata of one window at a time where it is large."""
        k, n = len(self.block_rows), self.n
        full = n // B
        per = max(1, self.CHUNK // max(1, hi - lo))         # batches made at once
        strata = np.arange(lo, hi, dtype=np.int64)[:, None]
        if not shuffle:
            return np.arange(k), self.starts, ((np.arange(s, min(full, s + per), dtype=np.int64)[:, None] * B
                                                + strata.T).reshape(-1) for s in range(0, full, per))
        rng = np.random.default_rng(np.random.SeedSequence([int(seed) % 2 ** 64, int(epoch), 2]))
        perm = rng.permutation(k)
        cum = np.concatenate([[0], np.cumsum(self.block_rows[perm])])
        window = self.window_rows(B) or max(B, full * B)

        def deal(strata_count, K):
            d = np.tile(np.arange(K, dtype=np.int32), (strata_count, 1))
            return rng.permuted(d, axis=1, out=d)

        def parts():
            a = 0
            while n - a >= B:
                K = min(window, n - a) // B
                W = min((n - a) // (K * B), self.CHUNK // (K * B))      # whole windows of K batches at once
                if W > 1:
                    d = deal(W * B, K).reshape(W, B, K)[:, lo:hi, :]
                    yield (a + np.arange(W)[:, None, None] * (K * B) + strata[None] * K + d).transpose(0, 2, 1) \
                        .reshape(-1)
                    a += W * K * B
                    continue
                step = max(1, self.CHUNK // K)          # strata drawn at once
                kept = []
                for r0 in range(0, B, step):
                    d = deal(min(B, r0 + step) - r0, K)
                    s0, s1 = max(r0, lo), min(r0 + len(d), hi)
                    if s0 < s1:
                        kept.append(d[s0 - r0:s1 - r0])
                d = np.concatenate(kept) if kept else np.zeros((0, K), np.int32)
                for j in range(0, K, per):
                    yield (a + strata * K + d[:, j:j + per]).T.reshape(-1)
                a += K * B
        return perm, cum, parts()


class Schedule:
    """One rank's Plans, epoch after epoch, addressed by the global step g (epoch g // spe,
    step g % spe of it): what the reader and the batch assembler walk. Plans are made
    on demand and the last few kept; thread-safe."""

    KEEP = 2        # the epoch being read, and the next (the reader looks a few steps ahead)

    def __init__(self, order, seed, global_batch, lo, hi, drop_last=True, shuffle=True):
        import threading
        self.order, self.seed = order, int(seed)
        self.B, self.lo, self.hi = int(global_batch), int(lo), int(hi)
        self.drop_last, self.shuffle = bool(drop_last), bool(shuffle)
        self.spe = steps_per_epoch(order.n, self.B, self.drop_last)
        self._plans = {}
        self._lock = threading.Lock()

    def plan(self, epoch):
        with self._lock:
            p = self._plans.get(epoch)
            if p is None:
                p = self.order.plan(self.seed, epoch, self.B, self.lo, self.hi, self.drop_last, self.shuffle)
                p.index = _index(p)
                self._plans[epoch] = p
                for old in sorted(self._plans)[:-self.KEEP]:
                    del self._plans[old]
            return p

    def rows(self, g):
        """(global row ids, block ids) of this rank's slice of global step g."""
        e, i = divmod(g, self.spe)
        return self.plan(e).step(i)

    def blocks(self, g):
        e, i = divmod(g, self.spe)
        return self.plan(e).step_blocks(i)

    def last_use(self, g, block):
        e, i = divmod(g, self.spe)
        return e * self.spe + int(self.plan(e).index["last"][block])

    def releases(self, g):
        e, i = divmod(g, self.spe)
        return self.plan(e).index["releases"].get(i, ())

    def next_use(self, g, block):
        """The first global step >= g of g's epoch that reads `block` (None: none)."""
        e, i = divmod(g, self.spe)
        steps = self.plan(e).index["steps_of"].get(block)
        if steps is None:
            return None
        k = int(np.searchsorted(steps, i))
        return e * self.spe + int(steps[k]) if k < len(steps) else None


def _block_steps(plan):
    """(blocks, steps): every distinct (block, step) pair of `plan` (its runs: a block is
    one run of a step, its rows being in position order), by block then step."""
    steps = np.repeat(np.arange(plan.steps, dtype=np.int32), np.diff(plan.run_ptr))
    order = np.lexsort((steps, plan.run_block))
    return plan.run_block[order], steps[order]


def _index(plan):
    """Per block its steps and last step; per step the blocks it is the last to read."""
    if plan.run_block is None or not len(plan.run_block):
        return {"last": {}, "releases": {}, "steps_of": {}}
    blocks, steps = _block_steps(plan)
    steps_of, last, releases = {}, {}, {}
    cuts = np.flatnonzero(np.diff(blocks)) + 1
    for chunk_b, chunk_s in zip(np.split(blocks, cuts), np.split(steps, cuts)):
        b = int(chunk_b[0])
        steps_of[b] = chunk_s
        last[b] = int(chunk_s[-1])
        releases.setdefault(int(chunk_s[-1]), []).append(b)
    return {"last": last, "releases": releases, "steps_of": steps_of}
