"""A chaos soak: N runs of the digits example, each hit by one random fault at a random time.

    python benchmarks/chaos.py [--runs 20] [--seed 0] [--no-network]

The job is conf/examples/digits.yaml (3 containers: 1 x 1 vcore + 2 x 0.5 vcore, ring
all-reduce, shares by vcores) on 3 emulated nodes (network namespaces, so a link can be
cut), with checkpoints every 20 steps and a 5 s heartbeat timeout. One uninterrupted
run gives the reference weights. Then every run gets a fault (each kind equally often, in
a random order) and draws a victim and a moment:

    sigkill      SIGKILL a random rank (rank 0 included) at a random step
    sigstop      SIGSTOP a random rank (a hang), found by its heartbeat
    ckpt-kill    a rank dies at a random checkpoint: after writing its part, right after
                 the commit, or half-way through the clean-up (YARNAPP_FAULT)
    link-cut     cut a random node's link (`yarnapp netem --cut`), restored 8 s later
    am-kill      SIGKILL the application master (the supervisor starts attempt 2)

Every fault must strike (cost a generation), and every run must end SUCCEEDED with final weights torch.equal to the reference, and leave
no process, cgroup or network namespace of it. The table gives, per run: fault, victim,
when (seconds after submit), detection (fault to the generation's abort record),
recovery (fault to the first step of the resumed world), the outcome. Medians at the
end; JSON in benchmarks/results/chaos.json. Needs root (cgroups, namespaces).
"""
import argparse
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import common  # noqa: E402

FAULTS = ("sigkill", "sigstop", "ckpt-kill", "link-cut", "am-kill")
CKPT_FAULTS = (("crash_in_checkpoint", None), ("crash_after_commit", 0), ("crash_in_cleanup", 0))
EVERY = 20
KEEP = 2           # complete checkpoints kept (a crash_in_cleanup needs KEEP + 1 of them)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-network", action="store_true", help="no emulated nodes (and no link cuts)")
    common.add_out(p, "chaos")
    return p.parse_args(argv)


def job(work, data, name, network, env=None):
    import yarnapp
    j = yarnapp.load(os.path.join(ROOT, "conf", "examples", "digits.yaml")).model_dump(mode="python")
    j["name"] = name
    j["training"]["data"] = {**j["training"]["data"], "train": f"{data}/train", "test": f"{data}/test"}
    j["training"]["log_every"] = 1
    j["checkpoint"].update(uri=os.path.join(work, name, "ckpt"), every_steps=EVERY, keep=KEEP)
    j["tensorboard"]["logdir"] = os.path.join(work, name, "tb")
    j["launcher"].update(heartbeat_timeout=5.0, poll_interval=0.1)
    j["max_restarts"] = 3
    if network:
        j["network"]["nodes"] = 3
    for g in j["groups"]:
        g["env"] = dict(env or {})
    return j


def step_of(run, rank=0):
    return ((run.status().get("progress") or {}).get(rank) or {}).get("step", -1)


def wait_until(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def leftovers(app_id):
    from yarnapp.backends.local import netem
    from yarnapp.backends.local.state import app_processes
    deadline = time.monotonic() + 10
    while True:
        left = {"processes": [p.pid for p in app_processes(app_id)],
                "cgroups": glob.glob(f"/sys/fs/cgroup/*/yarnapp/{app_id}"),
                "namespaces": [n for n in netem.namespaces() if n.startswith(netem.prefix(app_id))]}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.2)


def draw_faults(rng, runs, network):
    """Every kind of fault equally often (as near as `runs` allows), in a random order."""
    kinds = [f for f in FAULTS if network or f != "link-cut"]
    faults = [kinds[i % len(kinds)] for i in range(runs)]
    rng.shuffle(faults)
    return faults


def run_once(i, fault, rng, work, data, network, total_steps):
    import yarnapp
    from launcher import keys
    from recovery_util import rank_pid, store_of
    victim = rng.randrange(3)
    env, at_step = {}, rng.randint(10, total_steps - 30)
    if fault == "ckpt-kill":
        kind, only = rng.choice(CKPT_FAULTS)
        victim = victim if only is None else only
        # A clean-up happens only once more than `keep` checkpoints exist.
        first = EVERY * (KEEP + 1) if kind == "crash_in_cleanup" else EVERY
        at_step = rng.choice(range(first, total_steps - EVERY, EVERY))
        env["YARNAPP_FAULT"] = f"{kind}:{at_step}:{victim}"
        fault = f"ckpt-kill ({kind})"
    spec = job(work, data, f"chaos{i}", network, env)
    t_submit = time.time()
    run = yarnapp.submit(spec)
    store = store_of(run)
    row = {"run": i, "fault": fault, "victim": f"rank {victim}" if fault != "am-kill" else "master",
           "at_step": at_step, "app": run.app_id}
    t_fault = None
    if not fault.startswith("ckpt-kill"):
        pid = rank_pid(run, victim)
        wait_until(lambda: step_of(run) >= at_step or run.state != "RUNNING", 600, "the step to strike at")
        t_fault = time.time()
        if fault == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif fault == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        elif fault == "am-kill":
            os.kill(run.status()["am_pid"], signal.SIGKILL)
        else:
            node = {c["rank"]: c["node"] for c in run.status()["containers"]}[victim]
            row["victim"] = f"{node} (rank {victim})"
            subprocess.run([sys.executable, "-m", "yarnapp.cli", "netem", run.app_id, "--node", node, "--cut"],
                           check=True, capture_output=True)
            time.sleep(8)
            subprocess.run([sys.executable, "-m", "yarnapp.cli", "netem", run.app_id, "--node", node, "--restore"],
                           check=False, capture_output=True)
    st = run.wait(timeout=900)
    abort = store.get(keys.abort(0))
    cause = json.loads(abort) if abort else {}
    if t_fault is None:                # a fault the job injected into itself: when it wrote its abort
        t_fault = cause.get("time")
    resumed = None
    formed1 = store.get(keys.formed(1))
    if formed1 and t_fault:
        resumed = json.loads(formed1)["time"] - t_fault
    weights = None
    if st["state"] == "SUCCEEDED":
        from training.checkpoint import load_final
        weights = load_final(spec["checkpoint"]["uri"], run.app_id)
    injected = fault.startswith("ckpt-kill")       # the rank reports its own death: nothing to detect
    row.update(t_s=round((t_fault or t_submit) - t_submit, 1),
               detect_s=round(cause["time"] - t_fault, 2) if cause.get("time") and t_fault and not injected
               else None,
               recover_s=round(resumed, 2) if resumed is not None else None,
               state=st["state"], restarts=len(st["restarts"]), resumed_from=(st.get("final") or {}).get("resumed_from"),
               reason=(cause.get("reason") or "")[:120], left=leftovers(run.app_id))
    return row, weights


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    import yarnapp
    from training.checkpoint import load_final
    from training.data import import_digits
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="yarnapp-chaos-")
    os.environ["YARNAPP_HOME"] = os.path.join(work, "home")
    network = not args.no_network
    rows = []
    t0 = time.time()
    try:
        data = os.path.join(work, "digits")
        import_digits(data)
        ref = job(work, data, "reference", network)
        st = yarnapp.submit(ref).wait(timeout=900)
        if st["state"] != "SUCCEEDED":
            sys.exit(f"Error: the reference run {st['state']}: {st.get('diagnostics')}")
        total = st["final"]["steps"]
        reference = load_final(ref["checkpoint"]["uri"])
        print(f"reference: {total} steps, accuracy {st['final']['accuracy']:.4f}, {st['final']['time_s']:.0f}s",
              flush=True)
        print(f"{'run':>3} {'fault':<30} {'victim':<16} {'t s':>6} {'detect s':>8} {'recover s':>9} "
              f"{'state':<9} {'equal':<5} left", flush=True)
        for i, fault in enumerate(draw_faults(rng, args.runs, network)):
            row, weights = run_once(i, fault, rng, work, data, network, total)
            row["bit_identical"] = bool(weights is not None and weights.keys() == reference.keys()
                                        and all(torch.equal(weights[k], reference[k]) for k in reference))
            row["struck"] = row["restarts"] > 0            # the fault happened and cost a generation
            row["ok"] = row["state"] == "SUCCEEDED" and row["bit_identical"] and not row["left"] and row["struck"]
            rows.append(row)
            print(f"{i:>3} {row['fault']:<30} {row['victim']:<16} {row['t_s']:>6} {row['detect_s']!s:>8} "
                  f"{row['recover_s']!s:>9} {row['state']:<9} {str(row['bit_identical']):<5} "
                  f"{row['left'] or '-'}{'' if row['struck'] else ' (the fault never struck)'}", flush=True)
            shutil.rmtree(os.path.join(work, f"chaos{i}"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = sum(r["ok"] for r in rows)
    med = {k: statistics.median([r[k] for r in rows if r[k] is not None] or [float("nan")])
           for k in ("detect_s", "recover_s")}
    by_fault = {}
    for r in rows:
        f = r["fault"].split(" ")[0]
        by_fault.setdefault(f, []).append(r)
    print(f"\n{ok}/{len(rows)} runs struck, SUCCEEDED, bit-identical, nothing left; median detection "
          f"{med['detect_s']:.2f}s, median recovery {med['recover_s']:.2f}s")
    for f, rs in sorted(by_fault.items()):
        d = [r["detect_s"] for r in rs if r["detect_s"] is not None]
        rec = [r["recover_s"] for r in rs if r["recover_s"] is not None]
        det = f"{statistics.median(d):.2f}s" if d else "- (the rank reports its own death)"
        print(f"  {f:<10} {len(rs):>2} runs  recovery {statistics.median(rec) if rec else float('nan'):.2f}s  "
              f"detection {det}")
    meta = {**common.machine_meta(), "runs": args.runs, "seed": args.seed, "network": network,
            "ok": ok, "median_detect_s": med["detect_s"], "median_recover_s": med["recover_s"],
            "wall_s": round(time.time() - t0, 1)}
    common.write_results(args.out, meta, rows)
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
