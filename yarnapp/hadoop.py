"""A local single-node Apache Hadoop (HDFS + YARN) for trying yarnapp on YARN without a
cluster, and for the test suite's real-YARN tests.

    yarnapp hadoop start        # NameNode, DataNode, ResourceManager, NodeManager
    eval "$(yarnapp hadoop env)"
    yarnapp submit job.yaml --backend yarn --wait
    yarnapp hadoop stop         # nothing of it keeps running

The jars are Apache Hadoop's own, from Maven Central: `conf/hadoop/pom.xml` pins one
version and `mvn dependency:copy-dependencies` fetches them once into
``<yarnapp cache>/hadoop-<version>/lib`` (yarnapp.hadoop_dist). The
configuration templates are `conf/hadoop/etc/`; `start` fills them in under the
cluster's directory (default ``$YARNAPP_HOME/hadoop``, else ``~/.yarnapp/hadoop``):

    etc/hadoop/     HADOOP_CONF_DIR: core-, hdfs-, yarn-site.xml, capacity-scheduler.xml
    bin/yarn        answers `yarn classpath --glob` (what skein's driver runs), and
                    `yarn application|logs|node|queue|rmadmin ...` through Hadoop's own CLI
                    classes (`yarn rmadmin -refreshQueues` after editing the queues)
    bin/hdfs        `hdfs dfs ...` (Hadoop's FsShell)
    data/           HDFS blocks and metadata, NodeManager directories
    logs/<daemon>.log, run/<daemon>.pid, cluster.json

Every daemon binds 127.0.0.1; only the NameNode's and the ResourceManager's ports are
fixed (port base + 20, 70, 30-33, 88: 28020, 28070, 28030-28033, 28088 by default).
The daemons run with the JPMS options Hadoop 3.4 documents for Java 17+ (HADOOP-19310).
Containers run as the user who started the cluster (DefaultContainerExecutor), with
the Python that started it first on PATH. YARN ACLs are on: the starting user is the
only YARN and queue administrator.
"""
import getpass
import json
import logging
import os
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import conf
from launcher.procs import process_state

from .errors import UsageError
from .hadoop_dist import HadoopError, fetch_jars, java_home, version

log = logging.getLogger(__name__)

TEMPLATES = os.path.join(os.path.dirname(conf.__file__), "hadoop")
DEFAULT_PORT_BASE = 28000
MIN_PORT_BASE, MAX_PORT_BASE = 1024, 65535 - 88       # unprivileged ports, the last at base+88
PORTS = {"nn_port": 20, "nn_http_port": 70, "rm_scheduler_port": 30, "rm_tracker_port": 31,
         "rm_port": 32, "rm_admin_port": 33, "rm_web_port": 88}
PORT_NAMES = {"nn_port": "NameNode RPC", "nn_http_port": "NameNode HTTP (WebHDFS)",
              "rm_scheduler_port": "ResourceManager scheduler", "rm_tracker_port": "ResourceManager tracker",
              "rm_port": "ResourceManager RPC", "rm_admin_port": "ResourceManager admin",
              "rm_web_port": "ResourceManager web (and its proxy)"}
# (name, main class, heap); started in this order, stopped in the reverse one.
DAEMONS = (("namenode", "org.apache.hadoop.hdfs.server.namenode.NameNode", "512m"),
           ("datanode", "org.apache.hadoop.hdfs.server.datanode.DataNode", "256m"),
           ("resourcemanager", "org.apache.hadoop.yarn.server.resourcemanager.ResourceManager", "768m"),
           ("nodemanager", "org.apache.hadoop.yarn.server.nodemanager.NodeManager", "512m"))
# What Hadoop 3.4 adds for Java 17+ (HADOOP-19310: hadoop-functions.sh's
# hadoop_finalize_jpms_opts, the same list as hadoop-project's extraJavaTestArgs).
JPMS_OPTIONS = ("-XX:+IgnoreUnrecognizedVMOptions",
                *(f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in (
                    "java.io", "java.lang", "java.lang.reflect", "java.math", "java.net", "java.text",
                    "java.util", "java.util.concurrent", "java.util.zip", "sun.security.util",
                    "sun.security.x509")))
# Every JVM of this single-node cluster (its daemons, the `yarn` and `hdfs` commands, skein's
# driver): the client compiler alone and the serial collector. A development cluster's JVMs
# start and idle more than they compute: its four daemons started in 8.9 s and 13.9 CPU-s,
# against 15.8 s and 26.8 CPU-s with the default tiered compilation, and idled at 4% of a core.
JAVA_OPTIONS = (*JPMS_OPTIONS, "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
START_TIMEOUT = 180.0


def default_root():
    from .backends.local.state import home
    return os.path.join(home(), "hadoop")


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as the daemons bind (TIME_WAIT is free)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_base(start=30000, stop=60000, step=100):
    """A port base whose fixed ports are all free now (the test suite's clusters)."""
    for base in range(start, stop, step):
        if all(port_free(base + off) for off in PORTS.values()):
            return base
    raise HadoopError("no free port base for a local Hadoop between 30000 and 60000")


def _pid_alive(pid, marker):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


class LocalHadoop:
    """One single-node cluster in `root`. `start()` and `stop()` are idempotent."""

    def __init__(self, root=None, port_base=None, vcores=None, memory_mb=None, owner=None):
        """`port_base`, `vcores`, `memory_mb`: None takes the cluster's own (its cluster.json),
        else the defaults (28000, 16, 16 GiB). A running cluster keeps its own: asked for
        others, start() refuses."""
        self.root = os.path.abspath(root or default_root())
        saved = self._saved()
        if port_base is not None and not MIN_PORT_BASE <= port_base <= MAX_PORT_BASE:
            raise UsageError(f"--port-base {port_base}: its ports run from base+20 to base+88; give a base from "
                              f"{MIN_PORT_BASE} to {MAX_PORT_BASE}")
        for name, value in (("--vcores", vcores), ("--memory", memory_mb)):
            if value is not None and value <= 0:
                raise UsageError(f"{name} {value}: the NodeManager needs more than 0")
        self.asked = {k: v for k, v in (("port_base", port_base), ("vcores", vcores), ("memory_mb", memory_mb))
                      if v is not None}
        self.port_base = port_base or saved.get("port_base") or DEFAULT_PORT_BASE
        self.vcores = vcores or saved.get("vcores") or 16
        self.memory_mb = memory_mb or saved.get("memory_mb") or 16384
        self.owner = owner or saved.get("owner") or os.environ.get("HADOOP_USER_NAME") or getpass.getuser()
        self.ports = {k: self.port_base + off for k, off in PORTS.items()}
        self.conf_dir = os.path.join(self.root, "etc", "hadoop")
        self.marker = f"-Dyarnapp.hadoop={self.root}"

    # -- where things are --------------------------------------------------
    def _saved(self):
        try:
            with open(os.path.join(self.root, "cluster.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    @property
    def default_fs(self):
        return f"hdfs://127.0.0.1:{self.ports['nn_port']}"

    @property
    def webhdfs(self):
        """The NameNode's WebHDFS as a URI training.fsutil.resolve opens."""
        return f"webhdfs://127.0.0.1:{self.ports['nn_http_port']}"

    @property
    def rm_web(self):
        return f"http://127.0.0.1:{self.ports['rm_web_port']}"

    def environ(self):
        """What a shell needs to use this cluster (`yarnapp hadoop env` prints it)."""
        return {"HADOOP_CONF_DIR": self.conf_dir, "JAVA_HOME": java_home(),
                "PATH": os.path.join(self.root, "bin") + os.pathsep + os.environ.get("PATH", ""),
                "SKEIN_CONFIG": os.path.join(self.root, "skein"),
                "SKEIN_DRIVER_JAVA_OPTIONS": " ".join(JAVA_OPTIONS)}

    def pid(self, name):
        try:
            with open(os.path.join(self.root, "run", f"{name}.pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid, self.marker) else None

    def running(self):
        return {name: self.pid(name) for name, _, _ in DAEMONS}

    # -- configuration -------------------------------------------------------
    def write_config(self, lib):
        values = {**{k: str(v) for k, v in self.ports.items()}, "data": os.path.join(self.root, "data"),
                  "owner": self.owner, "vcores": str(self.vcores), "memory_mb": str(self.memory_mb),
                  "conf_dir": self.conf_dir, "lib": lib, "python_bin": os.path.dirname(sys.executable)}
        os.makedirs(self.conf_dir, exist_ok=True)
        src = os.path.join(TEMPLATES, "etc")
        for name in sorted(os.listdir(src)):
            with open(os.path.join(src, name)) as f:
                text = string.Template(f.read()).safe_substitute(values)
            with open(os.path.join(self.conf_dir, name), "w") as f:
                f.write(text)
        secret = os.path.join(self.root, "data", "http-secret")
        os.makedirs(os.path.dirname(secret), exist_ok=True)
        if not os.path.exists(secret):
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(16).hex())
        self._write_shims(lib)

    def _write_shims(self, lib):
        bindir = os.path.join(self.root, "bin")
        os.makedirs(bindir, exist_ok=True)
        java = os.path.join(java_home(), "bin", "java")
        cp = f"{self.conf_dir}:{lib}/*"
        head = (f"#!/bin/sh\n# Written by `yarnapp hadoop start` for the local Hadoop in {self.root}.\n"
                f"JAVA={java}\nCP='{cp}'\nOPTS='{' '.join(JAVA_OPTIONS)}'\n")
        yarn = head + """case "$1" in
  classpath) echo "$CP" ;;
  application|applicationattempt|container)
    exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.yarn.client.cli.ApplicationCLI "$@" ;;
  logs) shift; exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.yarn.client.cli.LogsCLI "$@" ;;
  node) shift; exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.yarn.client.cli.NodeCLI "$@" ;;
  queue) shift; exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.yarn.client.cli.QueueCLI "$@" ;;
  rmadmin) shift; exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.yarn.client.cli.RMAdminCLI "$@" ;;
  *) echo "this yarn answers: classpath, application, applicationattempt, container, logs, node, queue, rmadmin" >&2
     exit 2 ;;
esac
"""
        hdfs = head + """case "$1" in
  dfs) shift; exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.fs.FsShell "$@" ;;
  dfsadmin) shift; exec "$JAVA" $OPTS -cp "$CP" org.apache.hadoop.hdfs.tools.DFSAdmin "$@" ;;
  classpath) echo "$CP" ;;
  *) echo "this hdfs answers: dfs, dfsadmin, classpath" >&2; exit 2 ;;
esac
"""
        for name, text in (("yarn", yarn), ("hdfs", hdfs)):
            path = os.path.join(bindir, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)

    # -- start -----------------------------------------------------------------
    def start(self, timeout=START_TIMEOUT):
        """Start every daemon that is not running and wait until HDFS and YARN answer.

        Returns {"fetch_s", "start_s", "started": [daemons started now]}.
        """
        t0 = time.monotonic()
        running = self.running()
        if all(running.values()):
            saved = self._saved()
            other = [f"{k} {saved[k]}" for k, v in self.asked.items() if saved.get(k) is not None and saved[k] != v]
            if other:
                raise HadoopError(f"the local Hadoop in {self.root} runs with {', '.join(other)}; `yarnapp hadoop "
                                  f"stop` first to start it with others")
            self.wait_ready(timeout)
            return {"fetch_s": 0.0, "start_s": time.monotonic() - t0, "started": []}
        if any(running.values()):
            raise HadoopError(f"the local Hadoop in {self.root} is half running "
                              f"({', '.join(n for n, p in running.items() if p)}); "
                              f"`yarnapp hadoop stop` first")
        for key, port in self.ports.items():
            if not port_free(port):
                raise HadoopError(f"port {port} ({PORT_NAMES[key]}) on 127.0.0.1 is taken by another process; "
                                  f"stop it or choose other ports with --port-base")
        lib, fetch_s = fetch_jars()
        self.write_config(lib)
        for d in ("logs", "run", "skein"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        with open(os.path.join(self.root, "cluster.json"), "w") as f:
            json.dump({"version": version(), "port_base": self.port_base, "owner": self.owner,
                       "vcores": self.vcores, "memory_mb": self.memory_mb}, f, indent=1)
        if not os.path.isdir(os.path.join(self.root, "data", "hdfs", "name", "current")):
            self._format(lib)
        started = []
        try:
            for name, cls, heap in DAEMONS:
                self._spawn(name, cls, heap, lib)
                started.append(name)
            self.wait_ready(timeout)
            self._prepare_hdfs()
        except BaseException:
            self.stop()
            raise
        took = time.monotonic() - t0
        log.info("local Hadoop %s up in %.1fs (jars fetched in %.1fs)", version(), took, fetch_s)
        return {"fetch_s": fetch_s, "start_s": took, "started": started}

    def _java(self, cls, heap, lib):
        return [os.path.join(java_home(), "bin", "java"), f"-Xmx{heap}", *JAVA_OPTIONS, self.marker,
                f"-Dhadoop.log.dir={os.path.join(self.root, 'logs')}",
                "-cp", f"{self.conf_dir}:{lib}/*", cls]

    def _daemon_env(self):
        env = dict(os.environ, HADOOP_CONF_DIR=self.conf_dir, JAVA_HOME=java_home())
        # Containers (packer: none) run `python3`: the Python that started the cluster.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env.pop("HADOOP_USER_NAME", None)
        return env

    def _format(self, lib):
        out = subprocess.run(self._java("org.apache.hadoop.hdfs.server.namenode.NameNode", "256m", lib)
                             + ["-format", "-force", "-nonInteractive"], capture_output=True, text=True,
                             env=self._daemon_env(), timeout=120)
        if out.returncode != 0:
            raise HadoopError(f"formatting HDFS failed (exit {out.returncode}): {_first_error(out.stdout)}")

    def _spawn(self, name, cls, heap, lib):
        logfile = os.path.join(self.root, "logs", f"{name}.log")
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(self._java(cls, heap, lib), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self._daemon_env(), cwd=self.root,
                                    start_new_session=True)
        with open(os.path.join(self.root, "run", f"{name}.pid"), "w") as f:
            f.write(str(proc.pid))
        deadline = time.monotonic() + 10        # until the child has exec'd java (its marker shows)
        while proc.poll() is None and not _pid_alive(proc.pid, self.marker) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _get(self, url, timeout=5):
        sep = "&" if "?" in url else "?"
        with urllib.request.urlopen(f"{url}{sep}user.name={urllib.parse.quote(self.owner)}",
                                    timeout=timeout) as r:
            return json.loads(r.read())

    def ready(self):
        """(hdfs ready, yarn ready): the NameNode out of safe mode with a live DataNode, and a
        RUNNING NodeManager registered with the ResourceManager."""
        hdfs = yarn = False
        try:
            info = self._get(f"http://127.0.0.1:{self.ports['nn_http_port']}/jmx"
                             f"?qry=Hadoop:service=NameNode,name=NameNodeInfo")["beans"][0]
            hdfs = not info.get("Safemode") and len(json.loads(info.get("LiveNodes") or "{}")) > 0
        except (OSError, ValueError, KeyError, IndexError):
            pass
        try:
            nodes = (self._get(f"{self.rm_web}/ws/v1/cluster/nodes").get("nodes") or {}).get("node") or []
            yarn = any(n.get("state") == "RUNNING" for n in nodes)
        except (OSError, ValueError, AttributeError):
            pass
        return hdfs, yarn

    def wait_ready(self, timeout=START_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            for name, _, _ in DAEMONS:
                if self.pid(name) is None:
                    raise HadoopError(f"the {name} exited while starting: "
                                      f"{_first_error(self.log_text(name))} (log: {self.log_path(name)})")
            hdfs, yarn = self.ready()
            if hdfs and yarn:
                return
            if time.monotonic() > deadline:
                waiting = [w for w, ok in (("HDFS", hdfs), ("YARN", yarn)) if not ok]
                raise HadoopError(f"{' and '.join(waiting)} did not answer within {timeout:.0f}s; "
                                  f"see the logs in {os.path.join(self.root, 'logs')}")
            time.sleep(0.5)

    def _prepare_hdfs(self):
        """/tmp (sticky, for aggregated logs) and the owner's home directory (skein stages there;
        the applications' checkpoints, TensorBoard files and results are under it: its own)."""
        base = f"http://127.0.0.1:{self.ports['nn_http_port']}/webhdfs/v1"
        for path, perm in (("/tmp", "1777"), ("/tmp/logs", "1777"), (f"/user/{self.owner}", "700")):
            for op in (f"MKDIRS&permission={perm}", f"SETPERMISSION&permission={perm}"):
                req = urllib.request.Request(f"{base}{path}?op={op}&user.name={self.owner}", method="PUT")
                with urllib.request.urlopen(req, timeout=30):
                    pass

    def log_path(self, name):
        return os.path.join(self.root, "logs", f"{name}.log")

    def log_text(self, name):
        try:
            with open(self.log_path(name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    # -- stop ------------------------------------------------------------------
    def stop(self, timeout=30.0):
        """Stop every daemon (SIGTERM, then SIGKILL) and every container process left; verify
        that nothing of the cluster runs. Returns the names of the daemons that were running."""
        stopped = []
        for name, _, _ in reversed(DAEMONS):
            pid = self.pid(name)
            if pid is not None:
                _terminate(pid, self.marker, timeout)
                stopped.append(name)
            try:
                os.unlink(os.path.join(self.root, "run", f"{name}.pid"))
            except FileNotFoundError:
                pass
        for pid in self.leftovers():
            _terminate(pid, None, 5.0)
        left = self.leftovers()
        if left:
            raise HadoopError(f"processes of the local Hadoop in {self.root} survived stop: {left}")
        return stopped

    def leftovers(self):
        """Pids of processes of this cluster: its daemons (by their marker) and containers (by
        a working directory under its NodeManager's directories)."""
        nm_dirs = os.path.join(self.root, "data", "nm-local") + os.sep
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            pid = int(entry)
            try:
                if _pid_alive(pid, self.marker) or os.readlink(f"/proc/{pid}/cwd").startswith(nm_dirs):
                    if _state(pid) != "gone":
                        out.append(pid)
            except OSError:
                continue
        return out

    def container_pids(self, app_id=None, wait_s=0.0):
        """Pids of container processes (of one application) still running on the NodeManager,
        after waiting up to wait_s for none to be left: YARN stops an application's containers
        after its final state is reported (the NodeManager hears of it at its next heartbeat,
        then signals them), so a client that saw the state may still see them for a moment."""
        deadline = time.monotonic() + wait_s
        while (pids := self._container_pids(app_id)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return pids

    def _container_pids(self, app_id):
        daemons = set(self.running().values())
        mark = os.path.join("appcache", app_id) if app_id else ""
        out = []
        for pid in self.leftovers():
            if pid in daemons:
                continue
            try:
                if mark in os.readlink(f"/proc/{pid}/cwd"):
                    out.append(pid)
            except OSError:
                continue
        return out

    def status(self):
        running = self.running()
        hdfs, yarn = self.ready() if any(running.values()) else (False, False)
        return {"root": self.root, "version": version(), "daemons": running, "hdfs_ready": hdfs,
                "yarn_ready": yarn, "default_fs": self.default_fs, "webhdfs": self.webhdfs,
                "resourcemanager": self.rm_web, "conf_dir": self.conf_dir, "owner": self.owner}


def _terminate(pid, marker, timeout):
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            state = _state(pid)
            if state == "gone" or (state == "running" and marker and not _pid_alive(pid, marker)):
                return
            time.sleep(0.1)


def _state(pid):
    """'gone' (or only a zombie left to reap), 'exiting' (its main thread a zombie while
    other threads still run and hold its sockets: a JVM ends so), or 'running'."""
    letter = process_state(pid)
    if letter is None:
        return "gone"
    if letter != "Z":
        return "running"
    try:
        return "exiting" if len(os.listdir(f"/proc/{pid}/task")) > 1 else "gone"
    except OSError:
        return "gone"


def _first_error(text):
    for line in text.splitlines():
        if " ERROR " in line or "Exception" in line:
            return line.strip()[:300]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no output"
