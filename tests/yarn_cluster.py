"""A real single-node Hadoop (yarnapp.hadoop) for the real-YARN tests: started once per
test session, stopped at its end, with skein's global driver for the CLI calls."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKEIN = [sys.executable, "-c", "import sys, skein.cli; sys.exit(skein.cli.main())"]


class Cluster:
    """The session's cluster: `env` is what a shell of its user needs; `backend()` an in-process
    YarnBackend on the session's skein driver."""

    def __init__(self, hadoop, timings):
        self.hadoop = hadoop
        self.timings = timings
        self.env = hadoop.environ()
        self.owner = hadoop.owner

    def backend(self):
        import skein

        from yarnapp.backends.yarn import YarnBackend
        skein_dir = self.env["SKEIN_CONFIG"]
        with open(os.path.join(skein_dir, "driver")) as f:
            address = json.load(f)["address"]
        client = skein.Client(address=address, security=skein.Security.from_directory(skein_dir))
        return YarnBackend(client=client)

    def cli(self, *args, timeout=600, env=None):
        """The real `yarnapp` command in a shell set up with `yarnapp hadoop env`."""
        return subprocess.run([sys.executable, "-m", "yarnapp.cli", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env, **(env or {})})

    def run(self, argv, timeout=300, env=None):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env, **(env or {})})

    def uri(self, path):
        return f"{self.hadoop.webhdfs}{path}"

    def storage(self):
        """The applications' default storage (yarn.storage unset)."""
        return self.uri(f"/user/{self.owner}/.yarnapp")


def start(tmp_path_factory):
    """Start the session's cluster; skip (with the reason) where Java, Maven or Maven Central is
    missing. Returns (Cluster, stop function)."""
    from yarnapp import hadoop, hadoop_dist
    root = tmp_path_factory.mktemp("hadoop")
    cluster = hadoop.LocalHadoop(str(root), port_base=hadoop.free_port_base(), vcores=16, memory_mb=16384)
    try:
        took = cluster.start()
    except hadoop_dist.HadoopUnavailable as e:
        pytest.skip(f"no local Hadoop: {e}")
    c = Cluster(cluster, took)
    t0 = time.monotonic()
    out = c.run(SKEIN + ["driver", "start", "--log", str(root / "logs" / "skein-driver.log")], timeout=120)
    if out.returncode != 0:
        cluster.stop()
        raise RuntimeError(f"skein's driver did not start: {out.stderr}")
    took["skein_driver_s"] = time.monotonic() - t0
    print(f"\nlocal Hadoop {hadoop.version()}: jars fetched in {took['fetch_s']:.1f}s, daemons up in "
          f"{took['start_s'] - took['fetch_s']:.1f}s, skein driver in {took['skein_driver_s']:.1f}s",
          file=sys.stderr)

    def stop():
        c.run(SKEIN + ["driver", "stop"], timeout=60)
        cluster.stop()
        left = cluster.leftovers()
        assert not left, f"processes of the local Hadoop left after stop: {left}"
    return c, stop
