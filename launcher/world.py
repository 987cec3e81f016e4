"""One MPI world across independently started containers, without ssh or mpiexec.

Every rank starts as an MPI singleton. Rank 0 opens a port and publishes its name in
the store; ranks 1..N-1 join in rank order: the current world collectively Accepts,
the joiner Connects, both sides Merge the intercommunicator (joiner high), so rank
order is deterministic (group order, then instance).

The members Accept only once the next joiner has said in the store that it connects
(keys.connecting): MPI's blocking Accept spins a core while it waits.

The handshake, before anyone becomes a member. Right after Accept, the joiner sends
{rank, token} over the intercommunicator, the token being an HMAC of the port name
under the per-application secret; rank 0 waits for it at most HELLO_TIMEOUT_S. Rank 0
then tells the joiner yes or no, and tells the world (a broadcast over the current
members). Only on yes do both sides Merge. A process that connects with a wrong token,
out of order, or says nothing, is refused: its intercommunicator is freed (MPI_Comm_free,
which, unlike Disconnect, does not wait for the peer), the refusal is logged, and the
world accepts again. So no foreign process can stall the world or become part of it.

Why singletons rather than Hydra (`mpiexec -launcher-exec`): each YARN container is
allocated, started and restarted on its own; with singletons no process of the world
is special to the resource manager, and the store is the only rendezvous. The price
is that a dead rank does not take the others down (they would block forever inside a
collective): the agent of every container watches its rank and the generation's abort
key and ends its rank, which is what recovery needs anyway. Needs MPICH 4.3
(5.0.x names every singleton "singleton": pmodels/mpich#7805).
"""
import hashlib
import hmac
import json
import logging
import time

from . import interrupts, keys

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0     # how long rank 0 waits for a connected joiner to say who it is
_TAG_HELLO, _TAG_VERDICT = 11, 12


class WorldAborted(RuntimeError):
    """The generation was aborted (by another rank's failure) while forming."""


class Refused(RuntimeError):
    """This process was refused by the world (wrong secret, or out of order)."""


def _token(secret, port):
    return hmac.new(secret.encode(), port.encode(), hashlib.sha256).hexdigest()


def _hello(inter, timeout):
    """The joiner's hello on intercommunicator `inter` (rank 0 of the world), or None if it
    says nothing within `timeout` seconds (the receive is then cancelled)."""
    req = inter.irecv(source=0, tag=_TAG_HELLO)
    deadline = time.monotonic() + timeout
    while True:
        done, msg = req.test()
        if done:
            return msg
        if time.monotonic() > deadline:
            req.Cancel()
            req.Free()
            return None
        time.sleep(0.005)


def _verdict(hello, expected, secret, port):
    """(admit?, why not) for a joiner's hello when `expected` is the next rank."""
    if hello is None:
        return False, f"said nothing within {HELLO_TIMEOUT_S:g}s"
    if not isinstance(hello, dict):
        return False, "sent no hello"
    if not hmac.compare_digest(str(hello.get("token")), _token(secret, port)):
        return False, f"wrong token (asked to join as rank {hello.get('rank')!r})"
    if hello.get("rank") != expected:
        return False, f"out of order (rank {hello.get('rank')!r}; rank {expected} is next)"
    return True, ""


def join(store, gen, rank, size, secret, timeout, aborted=lambda: False):
    """Form generation `gen` of the world; return (intracomm, seconds it took)."""
    from mpi4py import MPI

    t0 = time.monotonic()
    comm = MPI.COMM_SELF.Dup()
    if size == 1:
        return comm, time.monotonic() - t0
    if rank == 0:
        port = MPI.Open_port()
        store.put(keys.port(gen), port)
    else:
        value = store.wait(keys.port(gen), timeout=timeout, cancel=aborted)
        if value is None:
            raise WorldAborted(f"generation {gen} aborted before rank {rank} joined")
        port = value.decode()
        if rank > 1 and store.wait(keys.joined(gen, rank - 1), timeout=timeout, cancel=aborted) is None:
            raise WorldAborted(f"generation {gen} aborted before rank {rank} joined")
        store.put(keys.connecting(gen, rank), json.dumps({"t": time.time()}))
        inter = MPI.COMM_SELF.Connect(port, MPI.INFO_NULL, root=0)
        inter.send({"rank": rank, "token": _token(secret, port)}, dest=0, tag=_TAG_HELLO)
        if not inter.recv(source=0, tag=_TAG_VERDICT):
            inter.Free()
            raise Refused(f"rank {rank} was refused by the world (secret or order mismatch)")
        comm = inter.Merge(high=True)
        inter.Disconnect()
        store.put(keys.joined(gen, rank), json.dumps({"t": time.time()}))
    # Members (rank 0 and every rank that has joined) accept the remaining joiners, each once
    # it says it connects: a blocking Accept spins a core until a joiner comes, which took the
    # CPU of the ranks still importing on the same host (a 3-rank world whose last rank was
    # 6 s late burnt 12 CPU-seconds); the store is polled idle.
    while comm.Get_size() < size:
        if store.wait(keys.connecting(gen, comm.Get_size()), timeout=timeout, cancel=aborted) is None:
            raise WorldAborted(f"generation {gen} aborted before rank {comm.Get_size()} joined")
        inter = comm.Accept(port if comm.Get_rank() == 0 else None, MPI.INFO_NULL, root=0)
        ok = None
        if comm.Get_rank() == 0:
            hello = _hello(inter, HELLO_TIMEOUT_S)
            ok, why = _verdict(hello, comm.Get_size(), secret, port)
            if hello is not None:
                inter.send(ok, dest=0, tag=_TAG_VERDICT)
            if not ok:
                log.warning("refused a process that connected to join generation %d: %s", gen, why)
        if comm.bcast(ok, root=0):
            merged = inter.Merge(high=False)
            inter.Disconnect()
            comm.Free()
            comm = merged
        else:
            inter.Free()
    if comm.Get_rank() == 0:
        MPI.Close_port(port)
    return comm, time.monotonic() - t0


# -- worlds of plain processes on this machine (the planner's link probe, benchmarks) ---------

LOCAL_WORLD_ENV = "YARNAPP_LOCAL_WORLD"     # "<store dir>:<rank>:<size>" for join_local()


def spawn_local(argv, size, env=None, **popen_kw):
    """Start `size` processes running `argv`, each told (LOCAL_WORLD_ENV) how to join one
    world with `join_local()`: singletons joined through a FileStore in a fresh directory,
    exactly as the containers of an application join, so they talk as the ranks of a job
    on one host do (over the network module, not shared memory). Each is a session of
    its own, as the local engine starts containers: where the kernel groups the CPU by
    session (autogroup), every rank gets its share, not one share for all of them.
    Returns (processes, store directory); the caller waits for the processes and removes
    the directory. Ctrl-C or SIGTERM while they start is handled once all are started,
    and then stops every one of them: none is left waiting for the rest of its world.
    Each dies with the process that started it, even one killed outright (SIGKILL, or a
    script without a SIGTERM handler stopped by `timeout`): a planner probe left behind
    would otherwise compute on for minutes on a node others share. (The kernel's signal
    follows the starting thread: call it from a thread that outlives the world.)"""
    import os
    import shutil
    import subprocess
    import tempfile

    from .procs import die_with_parent
    parent = os.getpid()

    def dies_with_parent():
        die_with_parent()
        if os.getppid() != parent:          # the parent died before the signal was set
            os._exit(1)

    root = tempfile.mkdtemp(prefix="yarnapp-world-")
    procs = []
    try:
        with interrupts.deferred():
            for rank in range(size):
                e = dict(os.environ if env is None else env)
                e[LOCAL_WORLD_ENV] = f"{root}:{rank}:{size}"
                procs.append(subprocess.Popen(argv, env=e, **{"start_new_session": True,
                                                             "preexec_fn": dies_with_parent, **popen_kw}))
    except BaseException:
        stop_all(procs)
        shutil.rmtree(root, ignore_errors=True)
        raise
    return procs, root


def stop_all(procs):
    """Kill every process first, then reap them: a second Ctrl-C while reaping leaves
    none running."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.kill()
    for p in running:
        p.wait()


def run_local(argv, size, env=None, timeout=600, grace=5.0):
    """spawn_local, wait for every process (at most `timeout` seconds in all; then the
    rest are killed and subprocess.TimeoutExpired is raised) and remove the store.
    Returns [(returncode, stdout, stderr)] in rank order. Once a process has failed (a
    non-zero exit), the others get `grace` seconds to end before they are killed (-9):
    they would wait for it in a collective until the timeout (a plan's probe whose master
    raised kept its worker waiting 180 s, and the line said nothing of why)."""
    import shutil
    import subprocess
    import threading
    import time
    procs, root = spawn_local(argv, size, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [None] * len(procs)

    def read(i, p):                 # every pipe drained at once: none blocks its writer
        try:
            outs[i] = p.communicate()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            outs[i] = e
    readers = [threading.Thread(target=read, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    try:
        for t in readers:
            t.start()
        deadline, failed = time.monotonic() + timeout, None
        while any(t.is_alive() for t in readers):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(argv, timeout)
            if failed is None and any(p.poll() not in (None, 0) for p in procs):
                failed = now
            if failed is not None and now - failed > grace:
                stop_all(procs)
            time.sleep(0.05)
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        return [(p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        stop_all(procs)
        for t in readers:
            if t.is_alive():            # Ctrl-C (or `kill`) may come while the readers start
                t.join(5.0)
        shutil.rmtree(root, ignore_errors=True)


def join_local(timeout=120):
    """In a process started by spawn_local: (comm, rank, size) of the joined world."""
    import os

    from .store import FileStore
    root, rank, size = os.environ[LOCAL_WORLD_ENV].rsplit(":", 2)
    comm, _ = join(FileStore(root), 0, int(rank), int(size), "local", timeout)
    return comm, int(rank), int(size)
