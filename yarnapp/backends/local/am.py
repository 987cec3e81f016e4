"""The local engine's application master: one detached process per application.

It owns the containers (a process group and cgroups each) and the coordination
store (a directory), writes `state.json` for clients in other shells, replaces a
container that exits abnormally (as YARN/skein restart a service instance) or that its
peers found frozen (launcher.keys.replace), and on
SIGTERM (`yarnapp kill`) or at the end leaves no process of the application behind.

    python -m yarnapp.backends.local.am APP_DIR
"""
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil

from launcher import exitcodes, keys, memory, tensorboard_service, warm, zygote
from launcher.network import cut_nodes
from launcher.failure import Failure, Kind, current_generation, log_tail
from launcher.procs import die_with_parent, wait_exit
from launcher.store import FileStore

from . import cgroups, gpus, leases, netem
from .leases import machine_memory_mib
from .state import app_processes, kill_words, read_json, write_state
from .supervisor import record_path
from .watchdog import Watchdog

log = logging.getLogger("yarnapp.am")

# What of the application's environment a zygote keeps (not a container's own: it would be
# every fork's until its environment is set); YARNAPP_APP_ID finds it among the application's processes.
ZYGOTE_ENV = ("YARNAPP_BACKEND", "YARNAPP_APP_ID", "YARNAPP_JOB", "YARNAPP_STORE", "YARNAPP_APP_DIR")
LOOK_S = 0.25      # how often the master looks at the store and its agents (a container's end: at once)


class Container:
    def __init__(self, member, group, app):
        self.id = member["container"]
        self.member = member
        self.group = group
        self.app = app
        self.dir = os.path.join(app.dir, "containers", self.id)
        self.workdir = os.path.join(self.dir, "work")
        self.log = os.path.join(self.dir, "container.log")
        os.makedirs(self.workdir, exist_ok=True)
        shipped = os.path.join(app.dir, "files")      # the user's code, staged at submit (yarnapp.shipping)
        if os.path.isdir(shipped):
            shutil.copytree(shipped, self.workdir, dirs_exist_ok=True, symlinks=True)
        self.limits = cgroups.Limits(app.app_id, self.id, group.vcores, group.memory)
        self.proc = None
        self.attempts = 0
        self.state = "NEW"
        self.exit_code = None
        self.exits = []
        self.node = None          # index of its emulated node (job.yaml network:), else None
        self.gpus = []            # the GPU indices it holds (CUDA_VISIBLE_DEVICES), leased by the master
        self.memory = None        # its memory cgroup's latest state (memory.state)
        self.memory_start = None  # ... and when its current attempt started
        self.group_index = next(i for i, g in enumerate(app.job.groups) if g.name == group.name)
        self.replacing = None     # why the master killed it to replace it (its agent went silent)

    def memory_state(self):
        return memory.state(self.limits.paths.get("memory"))

    def environment(self):
        env = dict(os.environ)
        env.update(self.group.env)
        env.update(YARNAPP_BACKEND="local", YARNAPP_APP_ID=self.app.app_id, YARNAPP_CONTAINER_ID=self.id,
                   YARNAPP_GROUP=self.group.name, YARNAPP_JOB=os.path.join(self.app.dir, "job.json"),
                   YARNAPP_SECRET=self.app.secret, YARNAPP_STORE=self.app.store.root,
                   YARNAPP_APP_DIR=self.app.dir, YARNAPP_LOG=self.log, YARNAPP_ATTEMPT=str(self.attempts),
                   PYTHONUNBUFFERED="1",
                   CUDA_VISIBLE_DEVICES=gpus.visible_devices(self.gpus))   # its own GPUs, or none
        return env

    def rank_environment(self, cwd):
        """The environment its ranks' warm process gets (launcher.agent.spawn), in `cwd`."""
        return warm.environment(self.environment(), self.group.env, self.member, cwd)

    def start(self):
        self.attempts += 1
        self.exit_code = None       # this attempt's, once it exits (the earlier ones stay in exits)
        self.started, self.beaten = time.monotonic(), False     # (ApplicationMaster.never_beaten)
        self.memory = self.memory_start = self.memory_state()
        env = self.environment()
        out = open(self.log, "ab")
        master = f", application master attempt {self.app.attempt}" if self.app.attempt > 1 else ""
        out.write(f"==== {self.id} attempt {self.attempts}{master} started {time.ctime()} "
                  f"(resources: {self.limits.why}) ====\n".encode())
        out.flush()
        limits = self.limits
        enter_node = None
        if self.node is not None:     # emulated nodes: the container lives in its node's network namespace
            env.update(self.app.network.container_env(self.node))
            enter_node = self.app.network.enter(self.node)

        zygote = self.app.zygotes.get(self.id)
        sock = zygote.connect() if zygote is not None else None
        if sock is not None:         # its warm processes forked from the zygote (launcher.zygote)
            env["YARNAPP_ZYGOTE"] = f"{sock.fileno()} {zygote.pid}"

        def setup():
            # A process group of its own, in the master's session (not one of its own): a warm
            # process a zygote forks joins it (launcher.zygote), so that the container's processes
            # are signalled, stopped and killed together.
            os.setpgid(0, 0)
            die_with_parent()
            limits.join()
            if enter_node:
                enter_node()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "launcher.agent"], cwd=self.workdir, env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=setup,
                                         pass_fds=(sock.fileno(),) if sock is not None else ())
        finally:
            out.close()
            if sock is not None:
                sock.close()
        self.state = "RUNNING"
        log.info("started %s (attempt %d%s, pid %d)", self.id, self.attempts, master, self.proc.pid)

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        group = self.proc.pid if self.proc else None
        for pid in self.limits.pids():      # those out of its process group too (once: a second SIGTERM
            try:                            # ran a rank's handler again, inside the first)
                if sig == signal.SIGKILL or os.getpgid(pid) != group:
                    os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def record(self):
        return {"id": self.id, "group": self.group.name, "instance": self.member["instance"],
                "rank": self.member["rank"], "state": self.state, "exit_code": self.exit_code,
                "exit": exitcodes.container_exit(self.exit_code),
                "attempts": self.attempts, "pid": self.proc.pid if self.proc else None, "log": self.log,
                "vcores": self.group.vcores, "memory_mib": self.group.memory, "gpus": self.group.gpus,
                "resources": self.limits.why, "exits": self.exits,
                "memory_peak_mib": memory.mib(self.memory["peak"]) if self.memory else None,
                "gpu_devices": list(self.gpus),
                **(self.app.network.member(self.node) if self.node is not None else {})}


class ApplicationMaster(Watchdog):
    def __init__(self, app_dir, attempt=1):
        self.attempt = attempt       # > 1: a previous attempt died (the supervisor restarted us)
        import conf
        self.dir = app_dir
        with open(os.path.join(app_dir, "job.json")) as f:
            self.job = conf.load_job(json.load(f), stored=True)
        with open(os.path.join(app_dir, "app.json")) as f:
            meta = json.load(f)
        self.app_id = meta["app_id"]
        self.secret = meta["secret"]
        self.submitted = meta["submitted"]
        self.store = FileStore(os.path.join(app_dir, "store"))
        groups = {g.name: g for g in self.job.groups}
        self.containers = [Container(m, groups[m["group"]], self) for m in self.job.ranks()]
        self.state = "ACCEPTED"
        self.diagnostics = ""
        self.stopping = None
        self.signum = None      # the signal that stopped it (state.kill_words)
        self.extra = {}
        self.network = None          # netem.Network of the emulated nodes, when the job has some
        self.tensorboard = None      # the tensorboard.service process, when the job asks for one
        self.beats_seen = {}         # container -> (its last beat, when the master saw it change)
        self.zygotes = {}            # container -> the launcher.zygote its warm processes are forked from
        self.looked = None           # when frozen_after_the_end last looked (monotonic)

    def save(self):
        write_state(self.dir, {
            "app_id": self.app_id, "name": self.job.name, "state": self.state, "am_pid": os.getpid(),
            "submitted": self.submitted, "diagnostics": self.diagnostics,
            "containers": [c.record() for c in self.containers], **self.extra})

    def on_signal(self, signum, frame):
        self.stopping = "KILLED"
        self.signum = self.signum or signum

    def container_exited(self, c, rc):
        self.store.release(c.id)
        c.exit_code = rc
        c.exits.append({"attempt": c.attempts, "exit_code": rc, "time": time.time()})
        failed = self.store.get(keys.FAILED) is not None
        c.memory = c.memory_state() or c.memory
        if rc == 0:
            c.state = "SUCCEEDED"
            return
        if rc == exitcodes.APP_FAILED or failed or self.stopping:
            c.state = "FAILED"
            return
        if c.replacing:
            # Killed to be replaced (frozen): whoever asked already ended the generation, naming it.
            c.replacing, what = None, "was killed as frozen"
        elif self._said_by_its_agent(c):
            what = "was stopped from outside (SIGTERM)"     # (its agent's record ended the generation)
        else:
            # The container itself died (not its rank): tell the world, then replace it.
            gen = current_generation(self.store)
            what, kind = exitcodes.describe(rc)[0], Kind.CONTAINER
            oom = memory.killed_for_memory(c.memory_start, c.memory, c.id, c.group_index)
            if oom:
                what, kind = f"was killed by the kernel: {oom}", Kind.OOM
            self.store.put_if_absent(keys.abort(gen), Failure(
                kind=kind.value, container=c.id, rank=c.member["rank"], exit_code=rc,
                reason=f"container {c.id} {what}", log=c.log,
                log_tail=log_tail(c.log)).stamped(generation=gen).dumps())
        if c.attempts <= self.job.max_restarts:
            log.warning("container %s %s; replacing it", c.id, what)
            c.start()
        else:
            c.state = "FAILED"

    def _said_by_its_agent(self, c):
        """Whether the container's agent, stopped from outside (SIGTERM), recorded that as the
        end of its generation (launcher.agent.main's on_term) before it exited: its peers have
        gone on to the next one, where a second record would end that one too, spending a
        restart (one SIGTERM cost two restarts)."""
        if c.exit_code != exitcodes.signalled(signal.SIGTERM):
            return False
        gen = current_generation(self.store)
        return any((f := Failure.load(self.store.get(keys.abort(g)))) is not None and f.container == c.id
                   and f.external for g in (gen, gen - 1) if g >= 0)

    def take_over(self):
        """Attempt n > 1: the previous master died, and its containers with it. Their owned
        keys go (as YARN releases a dead container's), and the world's generation they were
        in ends as not the job's fault (it spends no restart), so the new containers form
        the next one and training resumes from the newest complete checkpoint."""
        for c in self.containers:
            self.store.release(c.id)
        gen = current_generation(self.store)
        how = next((a.get("how") for a in (read_json(record_path(self.dir)) or {}).get("attempts", [])
                    if a.get("attempt") == self.attempt - 1), None)     # the supervisor's words: killed, stopped
        why = (f"the application master (attempt {self.attempt - 1}) {how}" if how else
               f"the application master died (attempt {self.attempt - 1})") + \
            f"; attempt {self.attempt} restarts every container"
        cause = Failure(kind=Kind.EXTERNAL.value, container="master", external=True, reason=why).stamped(generation=gen)
        if self.store.put_if_absent(keys.abort(gen), cause.dumps()):
            self.store.put_if_absent(keys.restart(gen + 1), dataclasses.replace(
                cause, aborted_generation=gen, generation=gen + 1).dumps())
        log.warning("%s", why)
        self.extra["am_attempt"] = self.attempt

    def run(self):
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        if self.attempt > 1:
            self.take_over()
        if not self.start_network() or not self.lease():
            self.stopping = self.stopping or "FAILED"
            return self.shutdown()
        self.start_zygotes()
        for c in self.containers:
            c.start()
        if self.job.tensorboard.service:
            self.tensorboard = tensorboard_service.start_local(self.dir, self.app_id, self.store.root)
        self.state, self.diagnostics = "RUNNING", ""
        self.save()
        failed_since = None
        parent = os.getppid()        # the supervisor (it starts the next attempt should this one die)
        handled = set()              # replacement requests acted on
        while True:
            changed = False
            self.replace_frozen(handled)
            self.never_beaten()
            self.frozen_after_the_end()
            self.supervisor_lost(parent)
            if self.tensorboard and self.tensorboard.poll() is not None:     # (killed: its URL went on in status)
                log.warning("the TensorBoard service exited with status %s", self.tensorboard.returncode)
                tensorboard_service.stop_local(self.tensorboard, self.store)
                self.tensorboard = None
            for c in self.containers:
                if c.state == "RUNNING":
                    rc = c.proc.poll()
                    if rc is not None:
                        self.container_exited(c, rc)
                        changed = True
            formed = self.store.get(keys.formed(0))
            if formed and "world_formed_s" not in self.extra:
                self.extra["world_formed_s"] = json.loads(formed)["time"] - self.submitted
                changed = True
            running = [c for c in self.containers if c.state == "RUNNING"]
            if self.stopping:
                break
            if not running:
                self.state = "SUCCEEDED" if all(c.state == "SUCCEEDED" for c in self.containers) else "FAILED"
                break
            if self.store.get(keys.FAILED) is not None or any(c.state == "FAILED" for c in self.containers):
                failed_since = failed_since or time.monotonic()
                if time.monotonic() - failed_since > 10:   # agents stop on their own; this is a backstop
                    self.stopping = "FAILED"
            if changed:
                self.save()
            # a container's end is seen at once; the rest (the store, frozen agents) a few times a second
            wait_exit([c.proc.pid for c in self.containers if c.state == "RUNNING" and c.proc], LOOK_S)
        self.shutdown()

    def start_zygotes(self):
        """A zygote (launcher.zygote) for every set of two or more containers whose ranks import
        alike on this host: not in an emulated node's network namespace, nor for code that
        imports nothing worth it (launcher.warm.imports)."""
        cwd = os.path.join(self.dir, "files")        # the user's code, staged at submit (a copy in each container)
        if not os.path.isdir(cwd):
            cwd = os.path.join(self.dir, "zygote")
            os.makedirs(cwd, exist_ok=True)
        if cgroups.unavailable() or not warm.imports(self.job, cwd):
            return
        alike = {}
        for c in self.containers:
            if c.node is None:
                env = c.rank_environment(cwd)
                alike.setdefault(json.dumps(zygote.key(env, cwd), sort_keys=True), []).append((c, env))
        for members in alike.values():
            if len(members) > 1:
                env = {k: v for k, v in members[0][1].items()
                       if (not k.startswith("YARNAPP_") or k in ZYGOTE_ENV) and k not in zygote.OWN}
                z = zygote.Zygote(env, cwd)
                log.info("zygote %d imports for containers %s", z.pid, ", ".join(c.id for c, _ in members))
                self.zygotes.update((c.id, z) for c, _ in members)

    def stop_zygotes(self):
        for z in set(self.zygotes.values()):
            z.stop()

    def lease(self):
        """Lease the job's GPUs (giving each container its own) and its memory from the
        machine's ledger (yarnapp.backends.local.leases); while other applications hold what
        it needs, wait (ACCEPTED, saying for whom). False if stopped while waiting."""
        want = [c.group.gpus for c in self.containers]
        memory = sum(c.group.memory for c in self.containers)
        ledger, capacity = leases.Leases(), machine_memory_mib()
        waited = None
        while not self.stopping:
            # held while its supervisor (which outlives a master attempt: a restarted master finds
            # its lease, or its place in line, still its own) or this master lives
            got, holders, ahead, short = ledger.acquire(self.app_id, sum(want), gpus.inventory() if sum(want) else [],
                                                 memory=memory, capacity=capacity,
                                                 pids=[os.getppid(), os.getpid()])
            if got is not None:
                for c, mine in zip(self.containers, gpus.split(got, want)):
                    c.gpus = mine
                if got:
                    log.info("GPUs leased: %s", {c.id: c.gpus for c in self.containers if c.gpus})
                return True
            if (holders, ahead, short) != waited:       # (whose they are: looked up once, not every second)
                waited = holders, ahead, short
                why = "waiting for " + " and ".join(
                    [f"{sum(want)} GPU(s)"] * ("gpus" in short)
                    + [f"{memory} MiB of memory (this machine's {capacity} MiB)"] * ("memory" in short)) + ": " + \
                    "; ".join(([f"held by {', '.join(ledger.whose(holders))}"] if holders else []) +
                              ([f"in line after {', '.join(ledger.whose(ahead))}, which asked first"] if ahead else [])
                              or ["too few visible"])
            if why != self.diagnostics:
                self.diagnostics = why
                log.info("%s", why)
                self.save()
            time.sleep(1.0)
        return False

    def start_network(self):
        """Emulated nodes (job.yaml network:): build them, place every container on one and
        publish where (launcher.keys.node). False, with the reason as the failure, if it fails."""
        if not self.job.network.nodes:
            return True
        try:
            netem.sweep_stale()
            self.network = netem.Network.for_job(self.app_id, self.job)
            placement = netem.place(self.job)
            self.network.create()
            cut = cut_nodes(self.store)   # a link cut before this master's restart stays cut
            for i in range(self.network.nodes):
                if self.network.node_name(i) in cut:
                    self.network.cut(i)     # (rebuilt whole, it came back unsaid, and failures named it cut)
                    log.info("%s's link stays cut (yarnapp netem --cut, before this master attempt)",
                             self.network.node_name(i))
        except netem.NetemError as e:
            log.error("cannot build the emulated network: %s", e)
            self.store.put_if_absent(keys.FAILED, Failure(kind=Kind.SETUP.value, reason=f"emulated network: {e}").dumps())
            return False
        for c in self.containers:
            c.node = placement[c.id]
            self.store.put(keys.node(c.id), json.dumps(self.network.member(c.node)))
        self.extra["network"] = self.network.describe()
        return True

    def stop_network(self):
        """Record what went over each node's link, then remove every namespace, veth and qdisc."""
        if self.network is None:
            return
        try:
            self.extra["network"]["counters"] = self.network.counters()
        except (netem.NetemError, KeyError, ValueError, OSError) as e:
            log.warning("could not read the emulated links' counters: %s", e)
        removed = self.network.remove()
        log.info("removed the emulated network: %s", " ".join(removed) or "nothing left")

    def shutdown(self):
        if self.stopping:
            self.state = self.stopping
        for c in self.containers:
            c.kill(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(c.proc and c.proc.poll() is None for c in self.containers):
            time.sleep(0.05)
        for c in self.containers:
            c.kill(signal.SIGKILL)
            if c.proc:
                rc = c.proc.wait()
                if c.state == "RUNNING":
                    c.state, c.exit_code = ("KILLED" if self.stopping == "KILLED" else "FAILED"), rc
            elif c.state == "NEW" and self.stopping == "KILLED":     # never started (it waited for GPUs)
                c.state = "KILLED"
        if self.tensorboard:
            tensorboard_service.stop_local(self.tensorboard, self.store)
        self.stop_zygotes()
        # Anything of this application that escaped its process group (it set up a
        # session of its own) is found by its environment and ended too.
        for p in app_processes(self.app_id, exclude=os.getpid()):
            try:
                p.kill()
            except psutil.Error:
                pass
        self.stop_network()
        deadline = time.monotonic() + 5     # a SIGKILLed rank (torch) takes a moment to leave its cgroup
        while time.monotonic() < deadline and any(c.limits.pids() for c in self.containers):
            time.sleep(0.05)
        for c in self.containers:
            c.memory = c.memory_state() or c.memory       # its peak, before the cgroup goes
            c.limits.remove()
        for name in os.listdir(self.store.root):          # a write a killed process left half done
            if name.startswith(".tmp."):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.store.root, name))
        try:
            leases.Leases().release(self.app_id)        # its lease, or its place in line
        except OSError as e:        # (a ledger this user cannot write: the lease goes with this process)
            log.warning("could not release this application's lease in the machine's ledger: %s", e)
        cgroups.Limits.remove_app(self.app_id)
        failed = self.store.get(keys.FAILED)
        if self.state == "FAILED":
            # No agent ended it (say every container died as it started: OOM-killed under a
            # tiny memory limit): the generation's abort record says why, else the exit status.
            last = max(current_generation(self.store) - 1, 0)     # the last generation aborted
            cause = Failure.load(failed) or Failure.load(self.store.get(keys.abort(last))) or next(
                (Failure(reason=f"container {c.id} {exitcodes.describe(c.exit_code)[0]}", kind=Kind.CONTAINER.value,
                         container=c.id, exit_code=c.exit_code, log=c.log)
                 for c in self.containers if c.state == "FAILED"), None)
            self.extra["failure"] = cause.as_dict() if cause else {}
            self.diagnostics = cause.reason if cause else ""
        elif self.state == "KILLED":
            self.diagnostics = kill_words(self.dir, self.signum, f"its application master (pid {os.getpid()})")
        self.extra["finished"] = time.time()
        self.save()
        log.info("application %s %s", self.app_id, self.state)


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("app_dir")
    p.add_argument("--attempt", type=int, default=1)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s am %(levelname)s: %(message)s")
    am = ApplicationMaster(args.app_dir, attempt=args.attempt)
    try:
        am.run()
    except BaseException:
        log.exception("application master crashed")
        am.stopping = "FAILED"
        am.diagnostics = "application master crashed; see am.log"
        am.shutdown()
        return 1
    finally:
        if am.network is not None:
            netem.sweep(am.app_id)      # however the AM ends, no namespace of it stays
    return 0


if __name__ == "__main__":
    sys.exit(main())
