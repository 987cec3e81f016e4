"""Streaming reads of a rank's blocks, ahead of training, within a byte budget.

A background thread walks the rank's Schedule step by step ahead of the consumer and
reads every block a step needs that is not in memory (through the dataset's pyarrow
filesystem: `read_row_group`, or a streamed row range of a big row group). A block
stays in memory until the last step of its epoch that reads it has been consumed.

The budget bounds the bytes of the blocks in memory: the thread reads ahead only while
they fit. When the consumer itself waits for a block that does not fit, the blocks
read again latest (Belady's choice: the farthest next use) are dropped to make room;
they are read again later, which the statistics count (`rereads`, `bytes_read`). Only
when a single step needs more than the whole budget is it exceeded (with a warning).

On a local filesystem the pages of a block's byte range are dropped from the page
cache once read (posix_fadvise DONTNEED): they would otherwise count against the
container's cgroup memory until the kernel reclaims them.
"""
import collections
import dataclasses
import logging
import os
import resource
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .common import BadData, DataChanged, DataError, one_line
from .decode import block_data
from .formats import row_group_span

log = logging.getLogger(__name__)

OPEN_FILES = 16                  # Parquet files kept open per rank
LOOKAHEAD_STEPS = 64             # the reader prepares at most this many steps (and one epoch) ahead


@dataclasses.dataclass
class ReadStats:
    blocks_read: int = 0
    rereads: int = 0             # blocks read again within one epoch (dropped for room)
    bytes_read: int = 0          # compressed bytes of the columns read (what crossed the filesystem)
    read_s: float = 0.0          # time the reader thread spent reading
    peak_bytes: int = 0          # most bytes of blocks in memory at once
    over_budget: int = 0         # times one step needed more than the budget


class _Files:
    """Open Parquet files of a layout, least recently used closed first."""

    def __init__(self, layout):
        self.layout = layout
        self.local = isinstance(layout.fs, pafs.LocalFileSystem)
        self._open = collections.OrderedDict()
        self._planned = None         # {file: {row group: (rows, its place in the file)}} as the job planned

    def get(self, i, streaming=False):
        key = (i, streaming)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key][0]
        f = self.layout.fs.open_input_file(self.layout.paths[i])
        # pages written with a CRC (yarnapp data import writes one) are verified as they are
        # read: ~1.5 GB/s of a core, where a page overwritten inside the file trained on garbage
        pf = pq.ParquetFile(f, pre_buffer=False, buffer_size=(1 << 20) if streaming else 0,
                            page_checksum_verification=True)
        self._as_planned(i, pf)
        fd = os.open(self.layout.paths[i], os.O_RDONLY) if self.local and hasattr(os, "posix_fadvise") else None
        self._open[key] = (pf, f, fd)
        while len(self._open) > OPEN_FILES:
            self._close(self._open.popitem(last=False)[1])
        return pf

    def _as_planned(self, i, pf):
        """File `i` as the job planned its epochs on it: the same rows in the same row groups at
        the same places. A file swapped for one of other rows mid-run was trained on without a
        word (the audit's shifted labels: test accuracy 0.003), and one cut shorter was "row
        group 0 holds 20 rows, its footer says 36": DataChanged, not retried."""
        if self._planned is None:       # (once: each file's, not a walk of every block at every open)
            self._planned = collections.defaultdict(dict)
            for b in self.layout.blocks:
                rows, _ = self._planned[b.file].get(b.row_group, (0, None))
                self._planned[b.file][b.row_group] = (rows + b.rows, tuple(b.span))
        planned = self._planned.get(i, {})
        md = pf.metadata
        now = {g: (md.row_group(g).num_rows, tuple(row_group_span(md.row_group(g))))
               for g in range(md.num_row_groups) if md.row_group(g).num_rows}
        if now != planned:
            then_rows, now_rows = sum(r for r, _ in planned.values()), sum(r for r, _ in now.values())
            raise DataChanged(f"{self.layout.name(i)}: changed while the job ran ({then_rows} rows in {len(planned)} "
                              f"row groups when it started, {now_rows} in {len(now)} now, or rewritten in place)"
                              f"{DataChanged.CHANGED}")

    def drop_cache(self, i, span):
        for (j, _), (_, _, fd) in self._open.items():
            if j == i and fd is not None:
                try:
                    os.posix_fadvise(fd, span[0], span[1], os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
                return

    @staticmethod
    def _close(entry):
        pf, f, fd = entry
        try:
            f.close()
        finally:
            if fd is not None:
                os.close(fd)

    def close(self):
        while self._open:
            self._close(self._open.popitem()[1])


# what requests and urllib3 raise for a server out of reach (fsspec's WebHDFS): not ConnectionError
_UNREACHED = {"ConnectionError", "NewConnectionError", "MaxRetryError", "ConnectTimeout", "ReadTimeout",
              "ProtocolError", "RemoteDisconnected"}


def _unreached(e):
    """The exception of `e`'s chain that says a server was out of reach (fsspec's OSError of
    a file's bare path hides a connection refused beneath), or None."""
    seen, visited = e, set()
    while seen is not None and id(seen) not in visited:
        if isinstance(seen, ConnectionError) or type(seen).__name__ in _UNREACHED:
            return seen
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return None


def read_block(layout, files, b):
    """BlockData of block b (a Block of the layout); DataError naming the file."""
    name = layout.name(b.file)
    cols = layout.file_columns(b.file)
    try:
        if b.whole:
            table = files.get(b.file).read_row_group(b.row_group, columns=cols, use_threads=False)
        else:
            pf = files.get(b.file, streaming=True)
            batches, at = [], 0
            for batch in pf.iter_batches(batch_size=max(1, b.rows), row_groups=[b.row_group], columns=cols,
                                         use_threads=False):
                end = at + batch.num_rows
                if end > b.offset:
                    batches.append(batch.slice(max(0, b.offset - at), b.offset + b.rows - max(at, b.offset)))
                at = end
                if at >= b.offset + b.rows:
                    break
            table = pa.Table.from_batches(batches).slice(0, b.rows)
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise DataChanged(f"{name}: removed while the job ran{DataChanged.CHANGED}") from None
        cause = _unreached(e)
        if cause is not None:
            # (a NameNode restarting read as corrupt data, the fix given: re-import a healthy dataset)
            raise DataError(f"{name}: cannot reach its filesystem ({type(cause).__name__}: {one_line(cause)}); "
                            f"it may be restarting") from None
        if "too many open files" in str(e).lower():     # (ulimit -n: not the data's fault)
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            raise DataError(f"{name}: cannot open it: too many open files (this container may open {soft}: "
                            f"`ulimit -n`); raise that limit where yarnapp submit runs, e.g. ulimit -n 4096 (on "
                            f"YARN, the NodeManager's)") from None
        content = isinstance(e, pa.ArrowInvalid) or any(w in str(e).lower() for w in ("checksum", "corrupt", "thrift"))
        raise (BadData if content else DataError)(      # a connection's error may pass; a bad page does not
            f"{name}: corrupt or unreadable Parquet data ({one_line(e)}); re-import the dataset "
            f"or check the filesystem") from None
    if table.num_rows != b.rows:
        raise BadData(f"{name}: row group {b.row_group} holds {table.num_rows} rows, its footer says {b.rows}")
    for column, values in layout.constant_columns(b.file, b.rows).items():     # from its Hive directories
        table = table.append_column(column, values)
    files.drop_cache(b.file, b.span)
    return block_data(table, layout, name), b.read_cost


class Cancelled(Exception):
    """acquire() of a reader that was cancelled (its iterator is closing)."""


class BlockReader:
    """Blocks of a Schedule in memory, read ahead in a thread, within `budget` bytes.

    acquire(g) -> {block id: BlockData} for global step g (waits for them);
    release(g) after the step's rows are copied out; cancel() makes a waiting acquire
    raise Cancelled; close() stops the thread and closes the files.
    """

    def __init__(self, layout, schedule, start, end, budget):
        self.layout, self.schedule = layout, schedule
        self.start, self.end = int(start), end          # end: None = forever
        self.budget = int(budget)
        self.stats = ReadStats()
        self._files = _Files(layout)
        self._resident = {}          # block id -> BlockData
        self._holds = {}             # block id -> set of global steps after which it may go
        self._size = {}              # block id -> bytes it takes (estimate, then actual)
        self._bytes = 0
        self._read_epoch = {}        # block id -> last epoch it was read in (rereads)
        self._io_step = self.start   # the step the thread prepares next
        self._consumer = self.start  # the step the consumer is at
        self._failure = None
        self._stop = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="yarnapp-reader", daemon=True)
        self._thread.start()

    # -- consumer side --------------------------------------------------------------

    def acquire(self, g):
        """{block id: BlockData} of the blocks step g reads, once all are in memory."""
        with self._cv:
            self._consumer = g
            self._cv.notify_all()
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._stop:
                    raise Cancelled()
                if self._io_step > g:
                    blocks = self.schedule.blocks(g)
                    return {b: self._resident[b] for b in blocks}
                self._cv.wait(0.5)

    def release(self, g):
        """Step g is consumed: drop the blocks whose last read in its epoch it was."""
        with self._cv:
            for b in self.schedule.releases(g):
                holds = self._holds.get(b)
                if holds is not None:
                    holds.discard(g)
                    if not holds:
                        self._drop(b)
            self._consumer = g + 1
            self._cv.notify_all()

    def cancel(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def close(self):
        self.cancel()
        self._thread.join()
        self._files.close()
        self._resident.clear()

    # -- the thread -------------------------------------------------------------------

    def _drop(self, b):
        self._resident.pop(b, None)
        self._holds.pop(b, None)
        self._bytes -= self._size.pop(b, 0)

    def _run(self):
        ahead = max(1, min(LOOKAHEAD_STEPS, self.schedule.spe))
        try:
            g = self.start
            while self.end is None or g < self.end:
                with self._cv:
                    while g >= self._consumer + ahead and not self._stop:
                        self._cv.wait(0.5)
                    if self._stop:
                        return
                for b in self.schedule.blocks(g):
                    if not self._ensure(g, b):
                        return
                with self._cv:
                    self._io_step = g + 1
                    self._cv.notify_all()
                g += 1
        except BaseException as e:  # handed to the consumer, which raises it
            with self._cv:
                self._failure = e
                self._cv.notify_all()

    def _ensure(self, g, b):
        """Make block b resident for step g (holding it until its last use); False: stop."""
        last = self.schedule.last_use(g, b)
        block = self.layout.blocks[b]
        with self._cv:
            if b in self._resident:
                self._holds[b].add(last)
                return True
            while not self._room_for(g, block.nbytes):
                if self._stop:
                    return False
                self._cv.wait(0.5)
            if self._stop:
                return False
            self._size[b] = block.nbytes
            self._bytes += block.nbytes
        t0 = time.perf_counter()
        data, cost = read_block(self.layout, self._files, block)
        with self._cv:
            epoch = g // self.schedule.spe
            self.stats.rereads += self._read_epoch.get(b) == epoch
            self._read_epoch[b] = epoch
            self.stats.blocks_read += 1
            self.stats.bytes_read += cost
            self.stats.read_s += time.perf_counter() - t0
            self._resident[b] = data
            self._holds[b] = {last}
            self._bytes += data.nbytes - self._size[b]
            self._size[b] = data.nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self._bytes)
        return True

    def _room_for(self, g, nbytes):
        """Whether nbytes more fit (called under the lock); when the consumer waits for
        step g itself, make room by dropping the blocks needed again latest."""
        if self._bytes + nbytes <= self.budget or not self._resident and not self._size:
            return True
        if self._consumer < g:
            return False                                # read-ahead waits for releases
        needed = set(self.schedule.blocks(g))
        victims = [b for b in self._resident if b not in needed]
        far = float("inf")
        victims.sort(key=lambda b: -(self.schedule.next_use(g, b) or far))
        while victims and self._bytes + nbytes > self.budget:
            self._drop(victims.pop(0))
        if self._bytes + nbytes > self.budget:
            if not self.stats.over_budget:
                log.warning("one step reads %s of blocks, more than the %s of the data memory left for blocks "
                            "(training.data.memory less the decoded steps ahead); lower training.data.shuffle_window "
                            "or raise training.data.memory", _size(self._bytes + nbytes), _size(self.budget))
            self.stats.over_budget += 1
        return True


def _size(nbytes):
    """1.5 MiB, 640 KiB: a size as a person reads it (a budget under 1 MiB read "0 MiB")."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{max(1, round(nbytes / 2**10))} KiB"
