"""Emulated nodes for the local engine: a small cluster network on one machine.

Each emulated node is a network namespace with one interface and its own address;
the nodes hang off one bridge that lives in a switch namespace of its own, so an
application's network is isolated from the host and from other applications (two
applications may use the same subnet). Nothing is created in the host's namespace:

    <p>-sw   switch namespace:  bridge <p>-br, ports <p>-h0 .. <p>-h{N-1}
    <p>-nI   node I namespace:  lo, <p>-nI  (address: host I+1 of the subnet)
             veth pair <p>-hI (switch side) <-> <p>-nI (node side)

`<p>` is `ya` + the 6 hex digits that end the application id, so every namespace of
an application can be found from its id alone, even after its AM was killed, and
interface names stay within Linux's 15 characters. Deleting the namespaces removes
every veth (a veth dies with either end) and every qdisc (they die with their
device), so removal is `ip netns del` of each `<p>-*` namespace.

A link of rate R is a tbf qdisc of rate R on both ends of the node's veth (full
duplex: what a node sends and what it receives are each limited to R). Latency is a
netem qdisc on the node side, so a message between two nodes is delayed once; the
kernel needs CONFIG_NET_SCH_NETEM for it. A cut takes the switch side of the node's
link down: the node keeps its address and route, and what it sends or is sent is
dropped, as when its cable is pulled.

A container is put on its node by `enter(i)` in its preexec_fn: setns(2) into the
node's network namespace only, so it keeps the host's mounts and sees its cgroup
(`ip netns exec` would remount /sys). The engine tells it where it is through
YARNAPP_NODE and YARNAPP_HOST_ADDR; launcher/network.py makes MPI use that address.

Everything here needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.
"""
import ctypes
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time

from ...errors import YarnappError

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^(ya[0-9a-f]{6})-(sw|n[0-9]+)$")
_TOKEN_RE = re.compile(r"_([0-9a-f]{6})$")
_probed = {}
_CLONE_NEWNET = 0x40000000


def _libc():
    return ctypes.CDLL("libc.so.6", use_errno=True)


class NetemError(YarnappError):
    """The emulated network cannot be created or changed; the message says why."""


def prefix(app_id):
    """`ya` + the application's 6-hex suffix (app_YYYYmmdd_HHMMSS_abc123 -> yaabc123)."""
    m = _TOKEN_RE.search(app_id)
    if not m:
        import hashlib
        return "ya" + hashlib.sha1(app_id.encode()).hexdigest()[:6]
    return "ya" + m.group(1)


def unavailable_reason(probe=False):
    """Why emulated nodes cannot be created here, or None when they can. With probe, a
    scratch namespace is created and removed (once per process) to be sure: root in a
    container without CAP_SYS_ADMIN cannot."""
    if os.geteuid() != 0:
        return (f"emulated nodes need root: creating network namespaces needs CAP_NET_ADMIN "
                f"(this runs as uid {os.geteuid()}); run as root or remove the job's network section")
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"emulated nodes need iproute2's `{tool}` command, which is not installed"
    if probe:
        if "netns" not in _probed:
            ns = _scratch_name()
            proc = _run("ip", "netns", "add", ns, check=False)
            _run("ip", "netns", "del", ns, check=False)
            _probed["netns"] = None if proc.returncode == 0 else (
                f"emulated nodes need root with CAP_SYS_ADMIN and CAP_NET_ADMIN, and here "
                f"`ip netns add` fails: {(proc.stderr or proc.stdout).strip()}")
        return _probed["netns"]
    return None


def _scratch_name():
    return f"yaprobe{os.getpid() % 0xffffff:06x}"


def _run(*argv, check=True):
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def namespaces():
    """Names of every network namespace `ip netns` knows."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def latency_supported():
    """Whether this kernel has the netem qdisc (probed once in a scratch namespace)."""
    if "netem" not in _probed:
        ns = _scratch_name()
        _run("ip", "netns", "add", ns)
        try:
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _probed["netem"] = _run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                                    "delay", "1ms", check=False).returncode == 0
        finally:
            _run("ip", "netns", "del", ns, check=False)
    return _probed["netem"]


def check(spec, where="job"):
    """Refuse, with one line naming the file and field, a network section that this
    machine cannot build or that places no container on some node."""
    net = spec.network
    if not net.nodes:
        return
    groups = len(spec.groups)
    if net.nodes > spec.world_size:
        raise NetemError(f"{where}: network.nodes: {net.nodes} nodes for {spec.world_size} containers; "
                         f"ask for at most {spec.world_size}")
    if net.placement == "by-group" and net.nodes > groups:
        raise NetemError(f"{where}: network.nodes: {net.nodes} nodes but placement by-group fills only "
                         f"{groups} (one per group); ask for at most {groups} or use placement: spread")
    if net.bandwidth is not None and not 10e3 <= net.bandwidth <= 100e9:
        raise NetemError(f"{where}: network.bandwidth: {net.bandwidth:g} bit/s cannot be emulated; "
                         f"give between 10kbit and 100gbit")
    hosts = ipaddress.IPv4Network(net.subnet).num_addresses - 2
    if net.nodes > hosts:
        raise NetemError(f"{where}: network.nodes: {net.nodes} nodes do not fit in subnet {net.subnet} "
                         f"({hosts} addresses)")
    why = unavailable_reason(probe=True)
    if why:
        raise NetemError(f"{where}: network.nodes: {why}")
    if net.latency is not None and not latency_supported():
        raise NetemError(f"{where}: network.latency: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), "
                         f"so latency cannot be emulated here; remove network.latency")


def place(spec):
    """{container id: node index} for the job's network section."""
    net = spec.network
    groups = [g.name for g in spec.groups]
    out = {}
    for m in spec.ranks():
        i = m["rank"] if net.placement == "spread" else groups.index(m["group"])
        out[m["container"]] = i % net.nodes
    return out


def _tbf(rate_bps):
    """tc arguments of a tbf shaping to rate_bps. The burst is ~1 ms of traffic (at least
    16 KiB): a bigger bucket lets a short message pass faster than the link (1 MiB went
    at 1.04x the rate of a 100 Mbit/s link with 192 KiB); the queue holds ~50 ms (a NIC
    queue's worth: TCP rarely loses a packet to it; measured 4 drops in 120 MB)."""
    byte_rate = rate_bps / 8
    burst = int(max(16384, byte_rate * 0.001))
    limit = int(max(4 * burst, byte_rate * 0.05))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


class Network:
    """The emulated network of one application (see the module docstring).

    `Network(app_id, nodes, subnet, rate_bps, delay_s)` only names things; `create()`
    builds them and `remove()` (or `sweep(app_id)`) removes them.
    """

    def __init__(self, app_id, nodes, subnet="10.77.0.0/24", rate_bps=None, delay_s=None):
        self.app_id = app_id
        self.prefix = prefix(app_id)
        self.nodes = nodes
        self.subnet = ipaddress.IPv4Network(subnet)
        if nodes > self.subnet.num_addresses - 2:
            raise NetemError(f"{nodes} nodes do not fit in subnet {subnet}")
        self.rate_bps = rate_bps
        self.delay_s = {i: delay_s for i in range(nodes)}
        self.hosts = list(itertools.islice(self.subnet.hosts(), nodes))

    @classmethod
    def for_job(cls, app_id, spec):
        net = spec.network
        return cls(app_id, net.nodes, net.subnet, net.bandwidth, net.latency)

    # -- names ---------------------------------------------------------------
    @property
    def switch(self):
        return f"{self.prefix}-sw"

    @property
    def bridge(self):
        return f"{self.prefix}-br"

    def node_name(self, i):
        return f"node{i}"

    def netns(self, i):
        return f"{self.prefix}-n{i}"

    def iface(self, i):
        """The node's interface, inside its namespace (what MPI binds to)."""
        return f"{self.prefix}-n{i}"

    def port(self, i):
        """The switch side of node i's link."""
        return f"{self.prefix}-h{i}"

    def addr(self, i):
        return str(self.hosts[i])

    def member(self, i):
        """What the store says about a container on node i (launcher.keys.node)."""
        return {"node": self.node_name(i), "addr": self.addr(i)}

    def container_env(self, i):
        """The environment that tells a container on node i where it is (launcher.network)."""
        return {"YARNAPP_NODE": self.node_name(i), "YARNAPP_HOST_ADDR": self.addr(i)}

    def enter(self, i):
        """A function that moves the calling process into node i's network namespace: for
        subprocess's preexec_fn. Only the network namespace changes (not the mounts, as
        `ip netns exec` would), so a container still sees its own cgroup under /sys/fs/cgroup."""
        path = os.path.join("/run/netns", self.netns(i))

        def enter():
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc().setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({path}): {os.strerror(err)}")
            finally:
                os.close(fd)
        return enter

    def describe(self):
        """What status shows: the nodes with their namespace, interface and address."""
        return {"prefix": self.prefix, "subnet": str(self.subnet), "bandwidth_bps": self.rate_bps,
                "nodes": [{"node": self.node_name(i), "netns": self.netns(i), "iface": self.iface(i),
                           "addr": self.addr(i), "latency_s": self.delay_s[i]} for i in range(self.nodes)]}

    # -- life cycle ------------------------------------------------------------
    def create(self):
        why = unavailable_reason()
        if why:
            raise NetemError(why)
        sweep(self.app_id)
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "set", "lo", "up")
            _run("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", self.bridge, "up")
            for i in range(self.nodes):
                ns = self.netns(i)
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", self.switch, "link", "add", self.port(i), "type", "veth",
                     "peer", "name", self.iface(i), "netns", ns)
                _run("ip", "-n", self.switch, "link", "set", self.port(i), "master", self.bridge, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/{self.subnet.prefixlen}",
                     "dev", self.iface(i))
                _run("ip", "-n", ns, "link", "set", self.iface(i), "addrgenmode", "none", "up")  # IPv4 only
                self._shape(i)
        except BaseException:
            self.remove()
            raise
        log.info("created %d emulated nodes %s in %s (bandwidth %s, latency %s)", self.nodes,
                 ", ".join(f"{self.node_name(i)}={self.addr(i)}" for i in range(self.nodes)), self.subnet,
                 f"{self.rate_bps:g} bit/s" if self.rate_bps else "unlimited",
                 f"{self.delay_s[0] * 1e3:g} ms" if self.delay_s[0] else "none")
        return self

    def remove(self):
        return sweep(self.app_id)

    def _shape(self, i):
        """(Re)build the qdiscs of node i's link from rate_bps and delay_s[i]."""
        ns, dev = self.netns(i), self.iface(i)
        delay = self.delay_s[i]
        _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        if delay:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", f"{delay * 1e6:.0f}us", "limit", "100000")
            if self.rate_bps:
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                     *_tbf(self.rate_bps))
        elif self.rate_bps:
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "10:", *_tbf(self.rate_bps))
        if self.rate_bps:
            _run("tc", "-n", self.switch, "qdisc", "replace", "dev", self.port(i), "root", "handle", "10:",
                 *_tbf(self.rate_bps))

    # -- fault injection ---------------------------------------------------------
    def _check_node(self, i):
        if not 0 <= i < self.nodes:
            raise NetemError(f"no node {i}: the application has nodes 0..{self.nodes - 1}")

    def cut(self, i):
        """Partition node i: its port is taken off the switch's bridge, so what it sends is
        dropped there. The link stays up, as a cable does behind a failed switch: taken down,
        the node's interface lost its carrier, and MPI_Init in a rank starting there failed
        at once (libfabric: "ep_enable failed ... Bad file descriptor"), which spent a
        restart every 3 s instead of waiting for the link in the rendezvous."""
        self._check_node(i)
        _run("ip", "-n", self.switch, "link", "set", self.port(i), "nomaster")

    def restore(self, i):
        """Put node i back on the switch (its qdiscs are kept)."""
        self._check_node(i)
        _run("ip", "-n", self.switch, "link", "set", self.port(i), "master", self.bridge, "up")

    def set_latency(self, i, delay_s):
        """One-way delay on node i's link (None or 0: none). Needs the netem qdisc."""
        self._check_node(i)
        if delay_s and not latency_supported():
            raise NetemError("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so latency "
                             "cannot be emulated here")
        self.delay_s[i] = delay_s or None
        self._shape(i)

    # -- observation ---------------------------------------------------------------
    def link_up(self, i):
        """Whether node i's link is up and on the switch (False once cut)."""
        proc = _run("ip", "-n", self.switch, "-j", "link", "show", "dev", self.port(i))
        link = json.loads(proc.stdout)[0]
        return "UP" in link.get("flags", []) and link.get("master") == self.bridge

    def counters(self):
        """{node name: {"rx_bytes", "tx_bytes", "rx_packets", "tx_packets"}} of each node's
        interface, as the kernel counts them (what went over the emulated links)."""
        out = {}
        for i in range(self.nodes):
            proc = _run("ip", "-n", self.netns(i), "-j", "-s", "link", "show", "dev", self.iface(i), check=False)
            if proc.returncode != 0:
                continue
            stats = json.loads(proc.stdout)[0].get("stats64", {})
            out[self.node_name(i)] = {f"{d}_{k}": stats.get(d, {}).get(k, 0)
                                      for d in ("rx", "tx") for k in ("bytes", "packets")}
        return out

    def qdiscs(self, i):
        """`tc qdisc show` lines of both ends of node i's link."""
        node = _run("tc", "-n", self.netns(i), "qdisc", "show", "dev", self.iface(i), check=False).stdout
        sw = _run("tc", "-n", self.switch, "qdisc", "show", "dev", self.port(i), check=False).stdout
        return node.splitlines() + sw.splitlines()


def for_app(app_id):
    """The Network of a local application, from its job (for `yarnapp netem`)."""
    import conf
    from .state import apps_dir, no_application, read_json
    job = read_json(os.path.join(apps_dir(), app_id, "job.json"))
    if job is None:
        raise NetemError(no_application(app_id))
    spec = conf.load_job(job, stored=True)
    if not spec.network.nodes:
        raise NetemError(f"application {app_id} has no emulated nodes (its job has no network.nodes)")
    net = Network.for_job(app_id, spec)
    if net.switch not in namespaces():
        raise NetemError(f"application {app_id} has no network now (it has ended, or is not started yet)")
    return net


def app_store(app_id):
    """The application's store (launcher.store.FileStore), where `yarnapp netem` leaves a
    record of a cut link for the agents (launcher.keys.cut)."""
    from launcher.store import FileStore

    from .state import apps_dir
    return FileStore(os.path.join(apps_dir(), app_id, "store"))


def sweep(app_id):
    """Remove every namespace of the application (and with them its veths and qdiscs),
    ending any process still inside one first. Returns the names removed."""
    p = prefix(app_id)
    removed = []
    for ns in namespaces():
        if ns.startswith(p + "-"):
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def sweep_stale(min_age_s=120):
    """Remove the networks of applications that no longer have any live process (their
    AM was SIGKILLed before it could clean up) and that are older than min_age_s (one
    being built right now has no process yet). Returns the names removed."""
    live = _live_tokens()
    removed = []
    for ns in namespaces():
        m = _NAME_RE.match(ns)
        if not m or m.group(1)[2:] in live:
            continue
        try:
            age = time.time() - os.stat(os.path.join("/run/netns", ns)).st_mtime
        except OSError:
            continue
        if age >= min_age_s:
            _kill_inside(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def _kill_inside(ns):
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _live_tokens():
    """The 6-hex suffixes of every application id in the environment of a live process."""
    out = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for item in env.split(b"\0"):
            if item.startswith(b"YARNAPP_APP_ID="):
                m = _TOKEN_RE.search(item.decode(errors="replace"))
                if m:
                    out.add(m.group(1))
    return out
