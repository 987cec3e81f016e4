"""Submit -> world formed on a real YARN: the local single-node Hadoop (yarnapp.hadoop),
at 3 and at 12 containers, against the embedded local engine at the same sizes.

Each run is a real `yarnapp submit` (the Python API) of tests/jobs/mpi_hello.py (no
torch: what is timed is allocation, container start and the world's forming), with
1-vcore containers on YARN (its NodeManager advertises 16 vcores on this 2-core
machine) and 0.5-vcore containers on the local engine. The time is `world_formed_s`:
from the submit (YARN's start time; the local engine's submit) to rank 0's record that
the whole world formed. Also prints the cluster's start-up times: cold (an empty jar
cache and Maven repository, as on a fresh machine: everything comes from Maven Central,
then HDFS is formatted) and warm (the daemons only).

    python benchmarks/yarn_world.py [--sizes 3,12] [--repeat 3] [--port-base 32000]
Prints a table and writes benchmarks/results/yarn_world.json.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import common  # noqa: E402
from common import machine_meta, write_results  # noqa: E402

import conf  # noqa: E402
import yarnapp  # noqa: E402
from yarnapp import hadoop  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "jobs", "mpi_hello.py")


def job(n, backend):
    vcores = 1 if backend == "yarn" else 0.5
    return conf.load_job({"name": f"world{n}", "backend": backend, "max_restarts": 0,
                          "groups": [{"name": "w", "instances": n, "vcores": vcores, "memory": "256 MiB",
                                      "env": {"PYTHONPATH": ROOT}}],
                          "run": {"script": SCRIPT, "editable": False}, "environment": {"packer": "none"},
                          "launcher": {"rendezvous_timeout": "300s"}})


def formed(run, timeout=600):
    st = run.wait(timeout=timeout)
    if st["state"] != "SUCCEEDED":
        raise SystemExit(f"Error: {run.app_id} {st['state']}: {st.get('diagnostics')}")
    return st["world_formed_s"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="3,12")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--port-base", type=int, default=None)
    common.add_out(p, "yarn_world")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    work = tempfile.mkdtemp(prefix="yarnapp-bench-")
    os.environ["YARNAPP_HOME"] = os.path.join(work, "home")      # an empty jar cache: the first start is cold
    os.environ["MAVEN_OPTS"] = (os.environ.get("MAVEN_OPTS", "") + f" -Dmaven.repo.local={work}/m2").strip()
    cluster = hadoop.LocalHadoop(os.path.join(work, "hadoop"), port_base=args.port_base or hadoop.free_port_base(),
                                 vcores=16, memory_mb=16384)
    cold = cluster.start()
    cluster.stop()
    warm = cluster.start()
    os.environ.update(cluster.environ())
    from yarnapp.backends.yarn import YarnBackend     # skein reads SKEIN_CONFIG when imported
    rows = []
    try:
        backend = YarnBackend()
        for n in sizes:
            for name in ("yarn", "local"):
                times = []
                for _ in range(args.repeat):
                    spec = job(n, name)
                    run = (yarnapp.api.Run(backend.submit(spec), backend, spec) if name == "yarn"
                           else yarnapp.api.start(spec))
                    times.append(formed(run))
                rows.append({"containers": n, "backend": name, "median_s": round(statistics.median(times), 2),
                             "runs_s": [round(t, 2) for t in times]})
                print(f"{n:>3} containers  {name:<6} submit -> world formed: median {rows[-1]['median_s']:6.2f}s "
                      f"{rows[-1]['runs_s']}", flush=True)
    finally:
        backend.client.close() if hasattr(backend, "_client") and backend._client else None
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    meta = {**machine_meta(), "hadoop": hadoop.version(), "repeat": args.repeat,
            "cluster_start_cold_s": round(cold["start_s"], 1), "jars_fetch_s": round(cold["fetch_s"], 1),
            "cluster_start_warm_s": round(warm["start_s"], 1)}
    print(f"cluster start: cold {meta['cluster_start_cold_s']}s (jars {meta['jars_fetch_s']}s, formats HDFS), "
          f"warm {meta['cluster_start_warm_s']}s")
    for n in sizes:
        y = next(r for r in rows if r["containers"] == n and r["backend"] == "yarn")["median_s"]
        lo = next(r for r in rows if r["containers"] == n and r["backend"] == "local")["median_s"]
        print(f"{n:>3} containers: YARN / local engine = {y / lo:.2f}")
    write_results(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
