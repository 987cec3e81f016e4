"""The planner's predicted step time against real jobs on 2 emulated nodes linked at 1 Gbit/s.

    sudo python benchmarks/netem_planner.py                 # seed_cnn conv1 8 / conv2 256, batch 32
    sudo python benchmarks/netem_planner.py --steps 60 --strategies allreduce

For each strategy (ring all-reduce, conv-layer model parallelism) one real job runs on
the local engine: 2 containers of 1 vcore each (one group `w`, so equal shares and
an equal kernel split; 1 vcore, not 1 + 0.5, because a 1-vcore container runs
unthrottled and so matches the planner's in-process, full-speed measurement without
the CFS-quota model in between), placed one per emulated node (`network: {nodes: 2,
placement: spread, bandwidth: 1gbit}`: network namespaces, veths shaped with tc tbf,
MPI over TCP; yarnapp/backends/local/netem.py), training on synthetic CIFAR
(training.data.import_synthetic_cifar, written to a temporary directory).

Measured step time: the median of the job's TensorBoard `time/step/w` scalars (the
mean wall time per step of the ranks over each window of `--log-every` steps), the
first `--skip` windows (warm-up: connections, allocator, first touch) left out.

Predicted step time: the planner's plan of that very job (training.planner.plan_job,
what `yarnapp plan JOB.yaml --bandwidth 1gbit` prints), the link
link_from_rate(1e9) (bandwidth_bps=(1e9,) in the options), the model measured layer by
layer in this process just before the job runs, while nothing else runs.

Prints strategy, predicted ms, measured ms, error % and whether within 20%, and writes
benchmarks/results/netem_planner.json. Needs root and `ip netns`; the jobs' networks
are removed by the engine when they end, and a job still running when this script
stops is killed.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import common  # noqa: E402  (machine description, JSON writer)

STRATEGIES = ("allreduce", "conv_model_parallel")
TARGET = 0.20
GROUP = "w"


def job_dict(strategy, a, data, work):
    """The benchmark's job for one strategy: 2 x 1 vcore on 2 nodes at `a.rate`."""
    name = {"conv_model_parallel": "netplan-conv-mp"}.get(strategy, "netplan-" + strategy.replace("_", "-"))
    return {"name": name,
            "groups": [{"name": GROUP, "instances": 2, "vcores": a.vcores, "memory": "2 GiB"}],
            "network": {"nodes": 2, "placement": "spread", "bandwidth": a.rate},
            "training": {"strategy": strategy, "model": a.model, "model_options": json.loads(a.options),
                         "data": {"train": f"{data}/train"}, "batch_size": a.batch,
                         "epochs": 1000, "max_steps": a.steps, "log_every": a.log_every,
                         "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "shares": "equal"},
            "checkpoint": {"uri": os.path.join(work, name, "ckpt"), "every_steps": 100_000},
            "tensorboard": {"logdir": os.path.join(work, name, "tb")},
            "max_restarts": 0}


def predict(job, rate_bps, quick):
    """The job's own plan with the link given by its rate (link_from_rate(rate_bps))."""
    import conf
    from training import planner
    opts = planner.PlanOptions(bandwidths_bps=(rate_bps,), machines=(2,),
                               min_time=planner.QUICK_MIN_TIME if quick else 0.2)
    return planner.plan_job(conf.load_job(job), opts)


def step_scalars(logdir, what="step"):
    """[(step, seconds)] of `time/<what>/<GROUP>` in the job's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (run,) = os.listdir(logdir)
    acc = EventAccumulator(os.path.join(logdir, run), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(f"time/{what}/{GROUP}")]


def run_job(job, timeout):
    """Run the job to its end on the local engine; its status and step-time windows."""
    import yarnapp
    run = yarnapp.submit(job, backend="local")
    try:
        st = run.wait(timeout=timeout)
    finally:
        if run.status()["state"] not in ("SUCCEEDED", "FAILED", "KILLED"):
            run.kill()
    if st["state"] != "SUCCEEDED":
        raise RuntimeError(f"{job['name']} ({run.app_id}) ended {st['state']}:\n{run.logs()[-4000:]}")
    tb = job["tensorboard"]["logdir"]
    parts = {k: [v for _, v in step_scalars(tb, k)] for k in ("compute", "comm", "data_wait")}
    return run.app_id, st, step_scalars(tb), parts


def leftover_namespaces():
    from yarnapp.backends.local import netem
    return [ns for ns in netem.namespaces() if ns.startswith("ya")]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--model", default="seed_cnn")
    p.add_argument("--options", default='{"conv1": 8, "conv2": 256}', help="model options as JSON")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vcores", type=float, default=1.0, help="vcores of each of the 2 containers")
    p.add_argument("--rate", default="1gbit", help="each node's link rate")
    p.add_argument("--steps", type=int, default=120, help="steps per job")
    p.add_argument("--log-every", type=int, default=10, help="steps per time/step window")
    p.add_argument("--skip", type=int, default=2, help="warm-up windows left out")
    p.add_argument("--train", type=int, default=4096, help="synthetic training images")
    p.add_argument("--quick", action="store_true", help="shorter planner measurements")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job")
    p.add_argument("--plan-only", action="store_true", help="print the predictions, run nothing")
    common.add_out(p, "netem_planner")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    from conf.units import parse_rate_bps
    from training.data import import_synthetic_cifar
    from yarnapp.backends.local import netem
    why = netem.unavailable_reason(probe=True)
    if why and not a.plan_only:
        print(f"Error: emulated nodes: {why}", file=sys.stderr)
        return 1
    rate_bps = parse_rate_bps(a.rate)
    names = [s for s in a.strategies.split(",") if s]
    work = tempfile.mkdtemp(prefix="netem-planner-")
    t0 = time.time()
    meta = dict(common.machine_meta(), args={k: v for k, v in vars(a).items() if k != "out"},
                group=f"2 x {a.vcores:g} vcore, one per emulated node", link_bps=rate_bps,
                measured="median of time/step/<group> windows after the first --skip",
                predicted="plan_job(job, PlanOptions(bandwidths_bps=(rate,))) -> strategies[s].step_s")
    rows = []
    try:
        data = os.path.join(work, "data")
        import_synthetic_cifar(data, n_train=a.train, n_test=256, shards=2)
        for name in names:
            job = job_dict(name, a, data, work)
            plan = predict(job, rate_bps, a.quick)          # right before the run, on a quiet machine
            pred = plan["strategies"][name]
            print(f"{name}: predicted {pred['step_s'] * 1e3:.1f} ms (compute {pred['compute_s'] * 1e3:.1f}, "
                  f"comm {pred['comm_s'] * 1e3:.1f}; single {plan['single_s'] * 1e3:.1f})",
                  file=sys.stderr, flush=True)
            if a.plan_only:
                continue
            load = os.getloadavg()[0]
            app_id, st, windows, parts = run_job(job, a.timeout)
            steady = [v for _, v in windows[a.skip:]]
            if not steady:
                raise RuntimeError(f"{name}: {len(windows)} windows, none after the {a.skip} skipped")
            measured = statistics.median(steady)
            err = (pred["step_s"] - measured) / measured
            rows.append({"strategy": name, "predicted_s": pred["step_s"], "measured_s": measured,
                         "error": err, "within_20pct": abs(err) <= TARGET, "app_id": app_id,
                         "windows": windows, "skipped_windows": a.skip,
                         "measured_parts_s": {k: statistics.median(v[a.skip:] or v) for k, v in parts.items()}, "loadavg_before": load,
                         "predicted": pred, "link": plan["link"], "single_s": plan["single_s"],
                         "model": plan["model"], "devices": plan["devices"]})
            print(f"{name}: measured {measured * 1e3:.1f} ms over {len(steady)} windows "
                  f"({', '.join(f'{v * 1e3:.0f}' for _, v in windows)} ms), error {100 * err:+.1f}%; median "
                  + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rows[-1]["measured_parts_s"].items()) + " ms",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.plan_only:
        return 0
    left = leftover_namespaces()
    meta.update(wall_s=round(time.time() - t0, 1), load_avg_after=os.getloadavg(), namespaces_left=left,
                summary={"within_20pct": sum(r["within_20pct"] for r in rows), "cases": len(rows)})
    print(f"{a.model} {a.options}, batch {a.batch}, 2 x {a.vcores:g} vcore on 2 emulated nodes at {a.rate}; "
          f"{a.steps} steps, median of {a.log_every}-step windows after {a.skip}")
    print(f"{'strategy':22s} {'predicted ms':>12s} {'measured ms':>12s} {'error':>8s}  within 20%")
    for r in rows:
        print(f"{r['strategy']:22s} {r['predicted_s'] * 1e3:12.1f} {r['measured_s'] * 1e3:12.1f} "
              f"{100 * r['error']:+7.1f}%  {'yes' if r['within_20pct'] else 'NO'}")
    if left:
        print(f"warning: namespaces left: {left}", file=sys.stderr)
    common.write_results(a.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
