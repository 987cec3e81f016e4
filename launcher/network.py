"""How a rank talks to the others when its container has a network address of its own.

On the local engine's emulated nodes (job.yaml `network:`) every container runs in
the network namespace of its node, with one interface and one address, and the
engine tells it which: YARNAPP_NODE (node0, node1, ...) and YARNAPP_HOST_ADDR. The
rank then makes MPI use exactly that, as it would on separate machines:

    MPIR_CVAR_CH4_NETMOD=ofi   libfabric, not UCX (this wheel's default): with UCX,
                               MPI_Comm_connect between two namespaces failed with
                               "Invalid port" after ~3 minutes (measured)
    FI_PROVIDER=tcp            plain TCP sockets (libfabric picks tcp;ofi_rxm on top)
    FI_TCP_IFACE=<iface>       the interface that carries the container's own address;
                               the port name then holds that address, not 127.0.0.1 (the
                               host name resolves to loopback here)
    MPIR_CVAR_NOLOCAL=1        never shared memory, even if MPICH thought two ranks were
                               on one host (for singletons joined by Connect/Accept it does
                               not use it anyway: measured, all traffic went over TCP)
    GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME = <iface>: torch.distributed over the same
                               interface (gloo otherwise binds the address the host name
                               resolves to, loopback here, and peers on other nodes fail
                               to connect: measured)

Without YARNAPP_HOST_ADDR nothing is changed (the default, shared-host behaviour).
`configure` runs in the rank process before `world.join` imports mpi4py, so the
settings are in place when MPI initializes.

`diagnose` is the agent's diagnosis when the world hangs or cannot form: which
members' nodes this container cannot reach (a TCP connect to a reachable host gets an
answer, accepted or refused, at once; a cut one never answers).
"""
import errno
import json
import logging
import os
import socket
import threading

from . import keys

log = logging.getLogger(__name__)

ADDR_ENV = "YARNAPP_HOST_ADDR"
NODE_ENV = "YARNAPP_NODE"
PROBE_PORT = 9          # discard: normally closed, so a reachable host answers with a reset


def interface_of(addr):
    """The name of the interface that carries IPv4 address `addr` in this namespace."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    raise RuntimeError(f"{ADDR_ENV}={addr} but no interface here has that address "
                       f"(interfaces: {', '.join(sorted(psutil.net_if_addrs()))})")


def mpi_env(addr):
    """The MPICH 4.3 settings for TCP over the interface of `addr`, nothing shared; and the
    same interface for torch.distributed's gloo and NCCL, whose own guess (the address the
    host name resolves to) is loopback here."""
    iface = interface_of(addr)
    return {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": iface,
            "MPIR_CVAR_NOLOCAL": "1", "GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}


def configure(environ=None):
    """Set the MPI transport for this container's own address, if it has one.

    Returns {"node", "addr", "iface"} (None without an address of its own).
    """
    env = os.environ if environ is None else environ
    addr = env.get(ADDR_ENV)
    if not addr:
        return None
    settings = mpi_env(addr)
    env.update(settings)
    log.info("network: node %s address %s: MPI over TCP on %s (%s)", env.get(NODE_ENV, "?"), addr,
             settings["FI_TCP_IFACE"], " ".join(f"{k}={v}" for k, v in settings.items()))
    return {"node": env.get(NODE_ENV), "addr": addr, "iface": settings["FI_TCP_IFACE"]}


def reachable(addr, timeout=1.0):
    """Whether a TCP connection attempt to `addr` gets any answer (accepted or refused)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((addr, PROBE_PORT))
        return True
    except ConnectionRefusedError:
        return True
    except OSError as e:
        return e.errno == errno.ECONNREFUSED
    finally:
        s.close()


def unreachable(peers, timeout=1.0):
    """The subset of `peers` ({name: addr}) this process cannot reach, probed in parallel."""
    out = {}

    def probe(name, addr):
        if not reachable(addr, timeout):
            out[name] = addr
    threads = [threading.Thread(target=probe, args=item, daemon=True) for item in peers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)
    return dict(sorted(out.items()))


def diagnose(members, me, timeout=1.0, cut=()):
    """One phrase naming the unreachable node(s), or "" when every member answers.

    members: {container: {"node", "addr"}} of the world; me: this container; cut: the
    nodes whose link `yarnapp netem --cut` cut (launcher.keys.cut). If this container
    reaches none of the other nodes (and there are at least two), it is its own node that
    is cut off; with two nodes, each side sees the other gone, and `cut` tells which.
    """
    mine = members.get(me)
    if not mine:
        return ""
    peers = {}
    for c, m in members.items():
        if m["node"] != mine["node"]:
            peers.setdefault(m["node"], m["addr"])
    if not peers:
        return ""
    lost = unreachable(peers, timeout)
    if not lost:
        return ""
    addrs = {m["node"]: m["addr"] for m in members.values()}
    named = [n for n in sorted(cut) if n in addrs]
    if named:
        return (f"{', '.join(f'{n} ({addrs[n]})' for n in named)} "
                f"{'is' if len(named) == 1 else 'are'} cut off (`yarnapp netem --cut`): from {me} on "
                f"{mine['node']}, {', '.join(f'{n} ({a})' for n, a in lost.items())} "
                f"{'does' if len(lost) == 1 else 'do'} not answer")
    if len(lost) == len(peers) and len(peers) >= 2:
        return (f"{mine['node']} ({mine['addr']}) is unreachable: from {me} on it, none of "
                f"{', '.join(f'{n} ({a})' for n, a in peers.items())} answers")
    return (f"{', '.join(f'{n} ({a})' for n, a in lost.items())} "
            f"{'is' if len(lost) == 1 else 'are'} unreachable from {mine['node']} ({mine['addr']})")


def cut_nodes(store):
    """The nodes whose link `yarnapp netem --cut` cut, as its records say (launcher.keys.cut)."""
    return {k.removeprefix(keys.CUT_PREFIX) for k in store.get_prefix(keys.CUT_PREFIX)}


def members_from(store):
    """{container: {"node", "addr"}} as the engine published them (empty without nodes)."""
    return {k.split("/", 1)[1]: json.loads(v) for k, v in store.get_prefix(keys.NODE_PREFIX).items()}
