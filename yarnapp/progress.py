"""Live progress of a run: a tqdm bar in a terminal, a widget in a notebook, and what rank 0's
code prints."""
import os
import re
import sys
import threading
import weakref

import conf
from launcher.failure import CRASH_BOILERPLATE

from .backends.base import TERMINAL

try:        # tqdm.auto's notebook widget needs ipywidgets; without it, it warns and falls back
    import ipywidgets  # noqa: F401
    from tqdm.auto import tqdm
except ImportError:
    from tqdm import tqdm


SHOWN = ("epoch", "loss", "accuracy", "test_loss", "test_accuracy", "samples_per_s")   # of a step's record


HIDDEN = ("rank", "time", "generation", "step", "total_steps",    # said otherwise, or not metrics
          "data_read_mb", "data_rereads", "data_blocks_peak_mib", "memory_limit_mib", "memory_peak_mib",
          "container_rss_peak_mib", "rss_peak_mib",     # the runner's resource counters (yarnapp status)
          "resumed_from", "resumed_app")                # said once (Progress.update)


def _shown(record):
    """The metrics of a progress record to show: the usual ones first, then whatever else
    own code reported (report(step=..., lr=...))."""
    return [k for k in SHOWN if k in record] + [k for k in record if k not in SHOWN and k not in HIDDEN]


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def metrics(record, skip=("model_uri",)):
    """`k=v ...` of a progress record or a final, as every line a user reads shows them (the
    built-in runner's final model_uri: its own line, `final_model`)."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k not in skip)


def final_model(st):
    """'model: URI' of the final model a SUCCEEDED run saved (the built-in runner's), or None."""
    uri = (st.get("final") or {}).get("model_uri")
    return f"model: {uri}" if uri else None


def notice(n):
    """A warning the ranks logged (launcher.results.notices), as status and --wait show it."""
    ranks = n.get("ranks") or []
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"warning ({who}): {n['text']}"


def _in_notebook():
    """In a Jupyter kernel, which has imported IPython already (importing it to ask took half a
    CPU-second of every `submit --wait` in a shell)."""
    if "IPython" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except Exception:
        return False


def _interactive(file):
    """A terminal or a notebook: somewhere a redrawn bar makes sense."""
    return _in_notebook() or (hasattr(file, "isatty") and file.isatty())


# A line of yarnapp's own in a container's log: an attempt's header, the agent's records, and
# the records of yarnapp's packages in a rank (launcher.rank's format: time, rank, container,
# logger). The rest is the code's own: what it printed, its warnings, its tracebacks.
_RECORD = (r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (agent \S+ [A-Z]+: |rank\d+ \S+ "
           rf"({'|'.join(conf.PACKAGES)})(\.[\w.]+)?: )")
_OURS = re.compile(rf"^(==== \S+ attempt \d+ started .* ====$|{_RECORD})")
_GLUED = re.compile(_RECORD)        # ours, after a line the code left without its newline
OUTPUT_CHUNK = 1 << 16      # bytes of rank 0's log read per update (a code printing faster is caught up later)
SKIP_BEHIND = 4 << 20       # ... unless this far behind: then skipped to its last chunk, saying so (a rank
                            # printing 1 MB/s left the terminal 40 s behind after a minute, and falling)


def rank0_streamed(st):
    """The container of rank 0 where a wait's progress shows its output (its log is a file
    here), or None."""
    c = next((c for c in st.get("containers") or [] if c.get("rank") == 0), None)
    return c if c and c.get("log") and os.path.isfile(c["log"]) else None


class Progress:
    live = weakref.WeakSet()    # the Progress displays open in this process (a sweep's threads each wait on one)

    def __init__(self, run, file=None, output=True):
        self.run = run
        Progress.live.add(self)
        self.tagged = False
        # In a notebook stderr renders red: messages and the bar go to stdout there.
        self.file = file or (sys.stdout if _in_notebook() else sys.stderr)
        self.bar = None
        self.said = set()
        self.last = None
        self.tty = _interactive(self.file)
        self.output = output
        self.read = {}              # a log's path -> how far it was shown

    def say(self, key, text):
        if key not in self.said:
            self.said.add(key)
            self._write(text)

    def _tag(self, text):
        """`text` as it is, or, once other waits showed theirs in this process or where it
        waits off the main thread (a sweep's pool: its last job alone no less), each line after
        its application's id (which line was whose; to its end, once begun)."""
        self.tagged = self.tagged or len(Progress.live) > 1 or \
            threading.current_thread() is not threading.main_thread()
        if not self.tagged:
            return text
        return "\n".join(line if line.startswith(self.run.app_id) else f"{self.run.app_id}: {line}"
                         for line in text.split("\n"))

    def _write(self, text):
        text = self._tag(text)
        if self.bar is not None:   # (tqdm's bool() raises for a bar without a total: own code's)
            self.bar.write(text, file=self.file)
        else:
            print(text, file=self.file, flush=True)

    def _rank0_output(self, st):
        """What rank 0's code wrote (prints, warnings, tracebacks; not yarnapp's own lines, nor a
        crash dump's list of modules), as torchrun shows it, prefixed with its container as
        `yarnapp logs --follow` does: where its log is a file here (the local engine; on YARN
        `yarnapp logs APP --follow`)."""
        c = rank0_streamed(st)
        if not self.output or c is None:
            return
        path, ended = c["log"], st["state"] in TERMINAL
        self._skip_ahead(c, path)
        while True:                 # a chunk a look; at the end, all of it, its last line too
            at = self.read.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(at)
                    data = f.read(OUTPUT_CHUNK)
            except OSError:         # (gone with its application's directory)
                return
            end = data.rfind(b"\n")
            if end < 0 and len(data) < OUTPUT_CHUNK and not ended:
                return              # a line still being written
            end = end if end >= 0 and not (ended and len(data) < OUTPUT_CHUNK) else len(data) - 1
            self.read[path] = at + end + 1
            lines, shown = data[:end + 1].decode(errors="replace").split("\n"), []
            for line in lines[:-1] if lines[-1] == "" else lines:
                line = line.rsplit("\r", 1)[-1]        # a bar redrawn in place: as a terminal shows it
                glued = _GLUED.search(line, 1)
                line = line[:glued.start()] if glued else line
                if not _OURS.match(line) and not line.startswith(CRASH_BOILERPLATE):
                    shown.append(f"{c['id']}| {line}")
            if shown:       # one write a chunk: in a notebook each write is a message (20,000 lines printed
                self._write("\n".join(shown))      # were 20,000, past Jupyter's 1,000 a second)
            if not ended or len(data) < OUTPUT_CHUNK:
                return

    def _skip_ahead(self, c, path):
        """Where rank 0's output is more than SKIP_BEHIND ahead of what was shown, go on from
        its last chunk's first whole line, saying how much was left out and where it is."""
        at = self.read.get(path, 0)
        try:
            size = os.path.getsize(path)        # (every update: opened only to skip)
            if size - at <= SKIP_BEHIND:
                return
            with open(path, "rb") as f:
                f.seek(size - OUTPUT_CHUNK)
                nl = f.read(OUTPUT_CHUNK).find(b"\n")
        except OSError:
            return
        to = size - OUTPUT_CHUNK + nl + 1 if nl >= 0 else size      # (no whole line there: from what comes)
        self.read[path] = to
        self._write(f"{c['id']}| [{(to - at) / 1e6:.1f} MB of its output left out here, to keep up: "
                    f"`yarnapp logs {self.run.app_id}` has all of it]")

    def update(self, st):
        n = len(st.get("containers") or [])
        containers = f"{n} containers, " if n > 1 else "1 container, " if n else ""
        self.say("submitted", f"{self.run.app_id}: {containers}state {st['state']}")
        if st["state"] in ("NEW", "ACCEPTED") and st.get("diagnostics") and "formed" not in self.said:
            # why it waits (for GPUs, say); not once its world formed (YARN's second master
            # attempt of a failed application: "Application is Activated, waiting for ...")
            self.say(f"waiting {st['diagnostics']}", f"{self.run.app_id}: {st['diagnostics']}")
        if st.get("world_formed_s") is not None:
            ranks = [c for c in st.get("containers") or [] if c.get("group") != conf.TENSORBOARD_SERVICE]
            self.say("formed", f"world formed {st['world_formed_s']:.2f}s after submit ({len(ranks)} ranks)")
        for r in st.get("restarts") or []:
            self.say(f"restart{r.get('generation')}", f"restart {r.get('generation')}: {r.get('reason')}")
        if st.get("tensorboard"):       # the service's page (again, should a restarted master's move)
            url = st.get("tensorboard_open") or st["tensorboard"]       # (on YARN: signed in, where needed)
            self.say(f"tensorboard {url}", f"tensorboard: {url}")
        self._notices(st)
        self._rank0_output(st)
        p = (st.get("progress") or {}).get(0)
        if p and p.get("resumed_from"):         # (the final line says it too: too late to learn it)
            app = p.get("resumed_app")
            self.say(f"resumed {app} {p['resumed_from']} {p.get('generation')}",
                     f"resumed from the checkpoint of step {p['resumed_from']}"
                     + (f" of {app}" if app and app != self.run.app_id else ""))
        if p and ("step" not in p or not self.tty):
            # One plain line per new progress record seen (the latest at each look, five a second:
            # a fast run's may skip some): not a terminal (CI, a log file), or a report
            # without a step (say training.dist's report(epoch=..., loss=...): no bar).
            head = f"step {p['step']}/{p.get('total_steps', '?')}" if "step" in p else "rank 0:"
            shown = _shown(p)
            if (shown or "step" in p) and p.get("time") != self.last:
                self.last = p.get("time")
                fields = "".join(f" {k}={_fmt(p[k])}" for k in shown)
                print(self._tag(f"{head}{fields} restarts={len(st.get('restarts') or [])}"), file=self.file,
                      flush=True)
            return
        if p and "step" in p:
            if self.bar is None:
                self.bar = tqdm(total=p.get("total_steps"), desc=self.run.app_id, file=self.file,
                                dynamic_ncols=True, leave=True)
            self.bar.total = p.get("total_steps") or self.bar.total
            self.bar.n = p["step"]
            self.bar.set_postfix({k: _fmt(p[k]) for k in _shown(p)}
                                 | {"restarts": len(st.get("restarts") or [])}, refresh=False)
            self.bar.refresh()

    def _notices(self, st):
        for n in st.get("notices") or []:
            self.say(f"notice {n['text']}", notice(n))

    def end(self, st, notices=True):
        """Say how the run ended (after any warning not said yet, unless `notices` is False: a
        wait's display said them): its final metrics, or why it failed."""
        if notices:
            self._notices(st)
        if st["state"] == "SUCCEEDED":
            final, model = metrics(st.get("final") or {}), final_model(st)
            self.say("end", f"{self.run.app_id} SUCCEEDED" + (f"; final: {final}" if final else "")
                     + (f"; {model}" if model else ""))
        else:
            self.say("end", self.run.failure_message())

    def close(self):
        Progress.live.discard(self)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
