"""What a YARN application's reports say, as the backend's plain dicts (see base.Backend):
skein's ApplicationReport, its containers and its key-value store become the records
`yarnapp status` shows; each container's log is found by the line its launch prints first."""
import json
import re

from launcher import exitcodes, keys, memory, results
from launcher.failure import Failure

MARKER = "yarnapp container"      # first log line of every container: maps YARN ids to ours
TENSORBOARD_PAGE = "tensorboard"  # the skein web UI page launcher.tensorboard_service adds


def app_state(report):
    """NEW | RUNNING | SUCCEEDED | FAILED | KILLED from a skein ApplicationReport."""
    state = str(report.state)
    if state == "FINISHED":
        final = str(report.final_status)
        return final if final in ("SUCCEEDED", "FAILED", "KILLED") else "FAILED"
    if state in ("RUNNING", "FAILED", "KILLED"):
        return state
    return "NEW"                    # NEW, NEW_SAVING, SUBMITTED, ACCEPTED


def app_record(report):
    """The record of an application report; a finished one's results come from its final
    diagnostics (launcher.results), which then read as one human line."""
    start = report.start_time
    rec = {"app_id": report.id, "name": report.name, "state": app_state(report), "containers": [],
           "final": None, "restarts": [], "diagnostics": report.diagnostics or "", "progress": {},
           "tensorboard": None, "world_formed_s": None, "failure": None, "user": report.user,
           "submitted": start.timestamp() if start else None, "tracking_url": report.tracking_url}
    found = results.from_diagnostics(report.diagnostics)
    if not found and report.diagnostics:         # YARN's own: a Java exception's message, not its frames
        lines = [ln.strip() for ln in report.diagnostics.splitlines()]
        rec["diagnostics"] = " ".join(ln for ln in lines if ln and not ln.startswith(("at ", "...")))
    if found:
        rec.update({k: found.get(k) for k in ("final", "failure", "world_formed_time")})
        rec["notices"] = found.get("notices") or []
        rec["restarts"] = found.get("restarts") or []
        rec["diagnostics"] = (found.get("failure") or {}).get("reason") or ""
        rec["results"] = "diagnostics"
    return rec


def container_record(c):
    m = re.search(r"exit code:?\s*(-?\d+)", c.exit_message or "", re.IGNORECASE)
    code = int(m.group(1)) if m else None
    rec = {"id": c.id, "group": c.service_name, "instance": c.instance, "state": str(c.state),
           "exit_code": code, "exit": exitcodes.container_exit(code, yarn=True), "attempts": 1, "rank": None,
           "log": c.yarn_container_logs, "diagnostics": c.exit_message or "",
           "yarn_id": c.yarn_container_id, "node": c.yarn_node_http_address}
    killed = memory.yarn_memory_kill(c.exit_message, code, c.id, c.service_name)
    if killed:                                   # the NodeManager's words, as the local engine's
        rec["memory_kill"] = rec["diagnostics"] = killed
    return rec


def name_memory_kills(record):
    """Restart and failure reasons that say a member's container was lost, reworded where
    that container was killed for its memory (YARN reports it per container only)."""
    kills = {c["id"]: c["memory_kill"] for c in record["containers"] if c.get("memory_kill")}
    for entry in [*(record.get("restarts") or []), record.get("failure") or {}]:
        lost = re.match(r"lost (\S+): ", entry.get("reason") or "")
        if lost and lost.group(1) in kills:
            entry["reason"] = kills[lost.group(1)]
    return record


def named_logs(logs):
    """{yarn container id: text} -> {our container id: text}, by each container's first line.

    The application master (no marker) is named "master".
    """
    out = {}
    for yarn_id, text in sorted(logs.items()):
        m = re.search(rf"^{MARKER} (\S+)", text, re.MULTILINE)
        name = m.group(1) if m else ("master" if "application.master.log" in text else yarn_id)
        out[name if name not in out else yarn_id] = text
    return out


def kv_fields(kv):
    out = {"progress": keys.progress_records(kv.get_prefix(keys.PROGRESS_PREFIX)),
           "restarts": [Failure.record(v) for _, v in sorted(kv.get_prefix(keys.RESTARTS).items())],
           "notices": results.notices(kv.get_prefix(keys.NOTICES))}
    final = kv.get(keys.FINAL)
    out["final"] = json.loads(final) if final else None
    out["failure"] = Failure.record(kv.get(keys.FAILED))      # the root cause, first failure wins
    tb = kv.get(keys.TENSORBOARD)
    out["tensorboard"] = tb.decode() if tb else None
    formed = sorted(k for k in kv.get_prefix(keys.ABORT_PREFIX) if k.endswith("/formed"))
    out["world_formed_time"] = json.loads(kv.get(formed[0])).get("time") if formed else None
    # Which rank each running container holds: a replacement (small_2) adopts a slot (small_0).
    beats = [(k[len(keys.BEAT_PREFIX):], json.loads(v)) for k, v in kv.get_prefix(keys.BEAT_PREFIX).items()]
    out["ranks"] = {b["engine_id"]: {"rank": b.get("rank"), "slot": slot} for slot, b in beats}
    return out


def with_ranks(record):
    """The containers' records with the rank (and slot) their agents hold (kv_fields' ranks)."""
    for c in record.get("containers") or []:
        held = (record.get("ranks") or {}).get(c["id"])
        if held:
            c["rank"] = held["rank"]
            if held["slot"] != c["id"]:
                c["slot"] = held["slot"]
    return record


def with_formed_s(record):
    """world_formed_s: seconds from submit (YARN's start time) to the first world formed."""
    t = record.get("world_formed_time")
    record["world_formed_s"] = (t - record["submitted"]) if t and record.get("submitted") else None
    return record


def proxied(tracking_url, page):
    """A skein web UI page through the ResourceManager's proxy (tracking URL + pages/<page>/)."""
    return f"{(tracking_url or '').rstrip('/')}/pages/{page}/"
