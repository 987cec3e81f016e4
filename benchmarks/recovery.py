"""Recovery time: from killing a rank to the first resumed training step.

Runs the digits job (3 ranks: 1 x 1 vcore + 2 x 0.5 vcore, ring all-reduce) on the
local engine, SIGKILLs rank 1 mid-run (or, with --fault crash, rank 0 exits with status
99 and no error line right after committing step 20: YARNAPP_FAULT), and times detection
(abort written), the new world formed, and the first step of the resumed generation. The alternative users
have elsewhere (TonY, tf-yarn: the whole application is restarted) is measured as a
fresh submit's time to its first step, the least such a restart costs.

    python benchmarks/recovery.py [--repeat 3] [--fault sigkill|crash]
Prints a table and writes benchmarks/results/recovery.json (recovery_crash.json).
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import yarnapp  # noqa: E402
from yarnapp.backends.local.state import wait_ended  # noqa: E402
from launcher import keys  # noqa: E402
from recovery_util import digits_job, rank_pid, store_of, wait_step  # noqa: E402


def first_step_of(run, generation, after_step, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = (run.status().get("progress") or {}).get(0) or {}
        if p.get("generation") == generation and p.get("step", -1) > after_step:
            return p["time"]
        time.sleep(0.01)
    raise TimeoutError("no resumed step")


def once(tmp, data, i, fault):
    env = {"YARNAPP_FAULT": "crash_after_commit:20:0"} if fault == "crash" else {}
    job = digits_job(tmp, data, f"rec{i}", steps=60, every=10, env=env)
    t_submit = time.time()
    run = yarnapp.submit(job)
    pid = rank_pid(run, rank=0 if fault == "crash" else 1)
    wait_step(run, rank=0, step=1)
    first_step = (run.status()["progress"][0])["time"]
    if fault == "crash":
        wait_ended(pid, timeout=300, interval=0.005)      # the rank's process ends
    else:
        wait_step(run, rank=1, step=15)
        os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    store = store_of(run)
    while store.get(keys.abort(0)) is None:
        time.sleep(0.005)
    t_detect = json.loads(store.get(keys.abort(0)))["time"]
    formed = json.loads(store.wait(keys.formed(1), timeout=300))["time"]
    t_resumed = first_step_of(run, 1, after_step=10)
    st = run.wait(timeout=600)
    assert st["state"] == "SUCCEEDED", st.get("diagnostics")
    return {"detect_s": t_detect - t_kill, "world_reformed_s": formed - t_kill,
            "first_resumed_step_s": t_resumed - t_kill, "resumed_from": st["final"]["resumed_from"],
            "fresh_submit_to_first_step_s": first_step - t_submit}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fault", choices=["sigkill", "crash"], default="sigkill")
    p.add_argument("--out", default=None, help="JSON to write (default results/recovery.json, "
                                               "results/recovery_crash.json for --fault crash)")
    args = p.parse_args(argv)
    from training.data import import_digits
    tmp = tempfile.mkdtemp(prefix="yarnapp-recovery-")
    atexit.register(shutil.rmtree, tmp, True)
    os.environ.setdefault("YARNAPP_HOME", os.path.join(tmp, "home"))
    import_digits(os.path.join(tmp, "digits"))
    rows = [once(__import__("pathlib").Path(tmp), os.path.join(tmp, "digits"), i, args.fault)
            for i in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{'run':>4} {'detect s':>9} {'re-formed s':>12} {'resumed step s':>15} {'fresh app s':>12}")
    for i, r in enumerate(rows):
        print(f"{i:>4} {r['detect_s']:>9.2f} {r['world_reformed_s']:>12.2f} {r['first_resumed_step_s']:>15.2f} "
              f"{r['fresh_submit_to_first_step_s']:>12.2f}")
    ratio = med["fresh_submit_to_first_step_s"] / med["first_resumed_step_s"]
    print(f"median: failure -> first resumed step {med['first_resumed_step_s']:.2f}s; a whole-application "
          f"restart needs at least {med['fresh_submit_to_first_step_s']:.2f}s ({ratio:.2f}x ours), "
          f"plus the steps since the user's own last checkpoint")
    out = args.out or os.path.join(HERE, "results", "recovery.json" if args.fault == "sigkill"
                                   else f"recovery_{args.fault}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"fault": args.fault, "runs": rows, "median": med, "whole_app_restart_over_ours": ratio,
                   "load_average": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
