"""What a YARN application leaves behind when it ends.

Skein's key-value store lives in the application master's memory and is gone once the
application ends, so `yarnapp status` of a finished application reads its results from
two places the agents fill in before it ends:

    <app dir>/result.json     on the cluster's default filesystem (launcher.identity's
                              app_dir: <YARNAPP_STORAGE>/<app id>): final, failure (with
                              the log tail), restarts, world_formed_time, state, and each
                              rank's last progress record
    YARN's final diagnostics  "yarnapp-result: {...}": the same without log tails, kept by
                              the ResourceManager with the application report

The agent of rank 0 publishes them on success, once every member is done; on failure
the first agent that sees FAILED does. Then it ends the application through skein
(`shutdown`), which also stops the TensorBoard service. The local engine's master
keeps its own records (state.json), so nothing here runs there.
"""
import json
import logging
import os
import re
import time

from . import keys
from .failure import Failure

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
DIAGNOSTICS_PREFIX = "yarnapp-result: "
PUBLISHED = "result/published"        # first writer publishes
DONE_WAIT_S = 30.0


NOTICES_KEPT = 10                     # in YARN's final diagnostics: the first ones, each cut to
NOTICE_CHARS = 300                    # this long (result.json keeps them all)


def notices(items):
    """The warnings the ranks published (launcher.rank.Notices: the store's notices/ items,
    {key: JSON}), oldest first; one entry per text, with the ranks that logged it."""
    out = {}
    for _, v in sorted(items.items()):
        n = json.loads(v)
        seen = out.setdefault(n["text"], {"text": n["text"], "ranks": [], "generation": n["generation"],
                                          "time": n["time"]})
        seen["ranks"] = sorted(set(seen["ranks"]) | {n["rank"]})
    return sorted(out.values(), key=lambda n: n["time"])


def collect(store):
    """The application's results from its store, in one store call."""
    seen = store.snapshot(prefixes=(keys.RESTARTS, keys.ABORT_PREFIX, keys.NOTICES, keys.PROGRESS_PREFIX),
                          keys=(keys.FINAL, keys.FAILED))
    formed = sorted(k for k in seen if k.startswith(keys.ABORT_PREFIX) and k.endswith("/formed"))
    return {"final": json.loads(seen[keys.FINAL]) if keys.FINAL in seen else None,
            # each rank's last record: what it read, its peak memory (result.json only, not the diagnostics)
            "progress": keys.progress_records(seen),
            "failure": Failure.record(seen.get(keys.FAILED)),
            "restarts": [Failure.record(v) for k, v in sorted(seen.items()) if k.startswith(keys.RESTARTS)],
            "world_formed_time": json.loads(seen[formed[0]]).get("time") if formed else None,
            "notices": notices({k: v for k, v in seen.items() if k.startswith(keys.NOTICES)})}


def diagnostics(result):
    """The one-line final diagnostics for YARN (no log tails: they may be long)."""
    slim = {k: v for k, v in result.items() if k != "progress"}
    if slim.get("failure"):
        slim["failure"] = {k: v for k, v in slim["failure"].items() if k != "log_tail"}
    slim["restarts"] = [{k: v for k, v in r.items() if k != "log_tail"} for r in slim.get("restarts") or []]
    slim["notices"] = [dict(n, text=n["text"][:NOTICE_CHARS]) for n in (slim.get("notices") or [])[:NOTICES_KEPT]]
    return DIAGNOSTICS_PREFIX + json.dumps(slim, separators=(",", ":"))


def from_diagnostics(text):
    """The result in a finished application's diagnostics, or None."""
    for line in (text or "").splitlines():
        if line.startswith(DIAGNOSTICS_PREFIX):
            try:
                found = json.loads(line[len(DIAGNOSTICS_PREFIX):])
            except ValueError:
                return None
            found["failure"] = Failure.record(found.get("failure"))
            found["restarts"] = [Failure.record(r) for r in found.get("restarts") or []]
            return found
    return None


def write(app_dir, result):
    from training import fsutil
    fs, root = fsutil.resolve(app_dir)
    fsutil.write_bytes(fs, f"{root}/{RESULT_FILE}", json.dumps(result, indent=1).encode())


def read(app_dir):
    from training import fsutil
    fs, root = fsutil.resolve(app_dir)
    return json.loads(fsutil.read_bytes(fs, f"{root}/{RESULT_FILE}"))


def master_attempt(container_id=None):
    """The master attempt a YARN container belongs to, from its id (YARN's $CONTAINER_ID:
    container_[e<epoch>_]<cluster>_<app>_<attempt>_<n>), or None where it does not say."""
    m = re.match(r"container_(?:e\d+_)?\d+_\d+_(\d+)_\d+$", container_id or os.environ.get("CONTAINER_ID", ""))
    return int(m.group(1)) if m else None


def ended_before(ident, store, wait_s=60.0):
    """On YARN, the start of a master attempt after an earlier one ended the application
    FAILED (skein shuts down a FAILED master without unregistering while attempts are left,
    so YARN starts the whole application again: it trained again, and a failure never
    retried came back as SUCCEEDED): end it at once with the same results, which the last
    attempt's master unregisters. True where this container is to exit now. Never raises."""
    if ident.backend != "yarn" or master_attempt() == 1:    # the first has no earlier one to read
        return False
    try:
        found = read(ident.app_dir)
    except Exception:  # noqa: BLE001 - none written (the first attempt, or storage out of reach)
        return False
    if found.get("state") != "FAILED":
        return False
    try:
        if store.put_if_absent(PUBLISHED, ident.container):
            log.info("an earlier attempt of this application failed: ending it as FAILED again")
            store.app.shutdown("FAILED", diagnostics(found))
        else:                       # another container ends it; exiting now could read as success
            time.sleep(wait_s)
    except Exception as e:  # noqa: BLE001
        log.warning("could not end the application after its earlier attempt failed: %s", e)
    return True


def publish_end(ident, store, code):
    """Called by every agent as it ends (launcher.agent.main): on YARN, the one agent whose
    turn it is writes the results and ends the application. Never raises."""
    if ident.backend != "yarn":
        return False
    try:
        if code == 0:
            if ident.rank != 0:
                return False
            members = [keys.done(r["container"]) for r in ident.job.ranks()]
            deadline = time.monotonic() + DONE_WAIT_S
            while time.monotonic() < deadline and not all(k in store.snapshot(prefixes=("done/",))
                                                           for k in members):
                time.sleep(0.2)
        elif store.get(keys.FAILED) is None or not store.put_if_absent(PUBLISHED, ident.container):
            return False
        result = {**collect(store), "state": "SUCCEEDED" if code == 0 else "FAILED", "time": time.time()}
        try:
            write(ident.app_dir, result)
        except Exception as e:      # the diagnostics still carry the results
            log.warning("could not write %s/%s: %s", ident.app_dir, RESULT_FILE, e)
        if code == 0:
            store.set_progress(1.0)
        log.info("application %s: results published; ending it", result["state"])
        store.app.shutdown(result["state"], diagnostics(result))
        return True
    except Exception as e:           # the application still ends through skein on its own
        log.warning("could not publish the application's results: %s", e)
        return False
