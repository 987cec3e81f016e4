"""The agent's state machine, fast: the real Agent and a real FileStore, with the rank
process replaced by scripted monitor results (as torch elastic's agent tests script their
workers). What the transitions write to the store and the container's exit status are
what the AM, status and results read."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import conf
from launcher import beats, exitcodes, keys, memory, stacks
from launcher.agent import SETUP_GRACE_S, TRANSITIONS, Agent, Outcome, State
from launcher.failure import Failure, Kind, log_tail
from launcher.identity import Identity
from launcher.retries import CERTAIN, INPUT_AGAIN, NO_DEVICE, NOT_RETRIED, NOT_RETRIED_AGAIN, OOM_AGAIN
from launcher.store import FileStore, SkeinStore

pytestmark = pytest.mark.unit


class ScriptedAgent(Agent):
    """Each generation's monitor result comes from `script`: (Outcome, Failure or None,
    a function of the store run first: what the other agents or the master did)."""

    def __init__(self, ident, store, script):
        super().__init__(ident, store)
        self.script = list(script)
        self.spawned_gens, self.killed, self.transitions = [], 0, []

    def spawn(self, gen):
        self.spawned_gens.append(gen)

    def kill_child(self):
        self.killed += 1

    def monitor(self, gen):
        outcome, failure, others = self.script.pop(0)
        if others:
            others(self.store, gen)
        return outcome, failure

    def step(self, state):
        nxt = super().step(state)
        self.transitions.append((state.name, nxt.name))
        return nxt


class ProcessAgent(Agent):
    """The real monitor, watching a stand-in for the rank process: generation g runs
    `commands[g]` (a plain command, not a rank), after `before(store, gen, agent)`."""

    def __init__(self, ident, store, commands, before=None):
        super().__init__(ident, store)
        self.heartbeat = os.path.join(ident.app_dir, "heartbeat")
        self.commands, self.before, self.children = list(commands), before, []

    def spawn(self, gen):
        self.memory_before, self._phase, self.spawned = None, "setup", time.monotonic()
        self.child = subprocess.Popen(self.commands.pop(0))
        self.children.append(self.child)
        if self.before:
            self.before(self.store, gen, self)


def agent(tmp_path, script, max_restarts=3, instances=1, rank=0, cls=ScriptedAgent, launcher=None, **kw):
    job = conf.load_job({"name": "states", "max_restarts": max_restarts,
                         "groups": [{"name": "w", "instances": instances}],
                         "run": {"function": "training.hello:main"},
                         "launcher": {"poll_interval": "10ms", **(launcher or {})}})
    os.makedirs(tmp_path, exist_ok=True)
    ident = Identity(backend="local", app_id="a", container=f"w_{rank}", group="w", instance=rank, rank=rank,
                     job=job, secret="s", app_dir=str(tmp_path))
    store = FileStore(str(tmp_path / "store"))
    return cls(ident, store, script, **kw), store


def crash(code=7, phase="train", error="RuntimeError: boom"):
    return Failure(kind=Kind.CRASHED.value, container="w_0", rank=0, exit_code=code, phase=phase, error=error,
                   reason=f"rank 0 (w_0) exited with status {code}: {error}")


def load(store, key):
    return Failure.load(store.get(key))


def test_a_log_with_only_the_engines_header_has_no_tail_to_show(tmp_path):
    """A rank killed for memory before it wrote a line: `submit --wait` showed "--- last
    lines of small_0's log ---" over the engine's header alone."""
    log = tmp_path / "container.log"
    log.write_text("==== small_0 attempt 1 started Sat Nov 28 04:20:00 2026\n\n")
    assert log_tail(str(log)) == ""
    with open(log, "a") as f:
        f.write("Traceback (most recent call last):\n  File \"x.py\", line 1\nMemoryError\n"
                "2026-11-28 05:51:34,929 agent small_0 INFO: RUNNING -> RESTARTING (generation 0)\n")
    assert log_tail(str(log), lines=3) == 'Traceback (most recent call last):\n  File "x.py", line 1\nMemoryError'
    with open(log, "a") as f:       # every attempt appends: a second one killed before its first line
        f.write("==== small_0 attempt 2 started Sat Nov 28 04:21:00 2026\n")
    assert log_tail(str(log)) == ""
    assert log_tail(str(tmp_path / "none.log")) == ""


def test_a_rank_that_succeeds_ends_the_container_with_0(tmp_path):
    a, store = agent(tmp_path, [(Outcome.SUCCEEDED, None, None)])
    assert a.run() == exitcodes.SUCCEEDED
    assert a.transitions == [("START", "RENDEZVOUS"), ("RENDEZVOUS", "RUNNING"), ("RUNNING", "SUCCEEDED")]
    assert json.loads(store.get(keys.done("w_0"))) == {"generation": 0}
    assert store.get(keys.alive("w_0")) is not None and store.get(keys.abort(0)) is None


def test_a_crash_restarts_in_the_next_generation_with_the_cause_recorded(tmp_path):
    a, store = agent(tmp_path, [(Outcome.OWN, crash(), None), (Outcome.SUCCEEDED, None, None)])
    assert a.run() == exitcodes.SUCCEEDED
    assert a.spawned_gens == [0, 1] and a.killed == 1
    assert ("RUNNING", "RESTARTING") in a.transitions and ("RESTARTING", "RENDEZVOUS") in a.transitions
    cause = load(store, keys.abort(0))
    assert (cause.reason, cause.generation, cause.exit_code, cause.kind) == (crash().reason, 0, 7, "crashed")
    restart = load(store, keys.restart(1))
    assert (restart.aborted_generation, restart.generation, restart.reason) == (0, 1, crash().reason)
    assert store.get(keys.FAILED) is None


def test_a_world_not_formed_is_recorded_by_the_agent_that_had_the_late_container_replaced(tmp_path):
    """Each agent judges a world that did not form at its own rendezvous limit: one whose
    limit came first found the late container running for less than the frozen limit
    (merely late) and recorded "missing: w_1"; one a moment later found it past that limit
    and had it replaced. The abort and the restart said only "missing: w_1" (a real-YARN
    run), though w_1 had been replaced: the record that names it wins."""
    plain = Failure(kind=Kind.NOT_FORMED.value, container="w_2", rank=2,
                    reason="world not formed within 20s; missing: w_1")
    named = dataclasses.replace(plain, container="w_0", rank=0, reason=plain.reason + (
        "; w_1 runs, but its agent never reported (frozen or stuck as it started, or still localizing its files: "
        "raise launcher.rendezvous_timeout for those); the resource manager is asked to replace it"))

    def first(store, gen):          # the other agent came first, abort and restart alike
        store.put(keys.abort(gen), plain.stamped(generation=gen).dumps())
        store.put(keys.restart(gen + 1), dataclasses.replace(plain, aborted_generation=gen,
                                                              generation=gen + 1).dumps())
    a, store = agent(tmp_path, [(Outcome.OWN, named, first), (Outcome.SUCCEEDED, None, None)], instances=3)
    assert a.run() == exitcodes.SUCCEEDED
    assert load(store, keys.abort(0)).reason == named.reason
    assert load(store, keys.restart(1)).reason == named.reason
    # a record that names no more stays the first writer's
    b, store = agent(tmp_path / "b", [(Outcome.OWN, plain, lambda st, g: st.put(keys.abort(g), named.dumps())),
                                      (Outcome.SUCCEEDED, None, None)], instances=3)
    assert b.run() == exitcodes.SUCCEEDED
    assert load(store, keys.abort(0)).reason == named.reason == load(store, keys.restart(1)).reason


def test_spent_restarts_fail_the_application_with_the_last_cause_and_the_ranks_status(tmp_path):
    """The failure that spent the last restart is the application's; the earlier one is the
    restart's record. (It named generation 0's, which the restart had survived: a rank
    killed once, then a checkpoint that would not load, read "killed by signal 9".)"""
    second = crash(code=9, error="ValueError: again")
    a, store = agent(tmp_path, [(Outcome.OWN, crash(), None), (Outcome.OWN, second, None)], max_restarts=1)
    assert a.run() == 9                                   # this container's rank caused it: its status
    assert a.transitions[-1] == ("RESTARTING", "FAILED") and a.spawned_gens == [0, 1]
    failed = load(store, keys.FAILED)
    assert (failed.reason, failed.attempts) == (second.reason, 2)
    assert load(store, keys.restart(1)).reason == crash().reason


def test_another_agents_abort_is_kept_and_followed(tmp_path):
    theirs = Failure(kind=Kind.HUNG.value, container="w_1", rank=1, reason="rank 1 (w_1) hung: no progress")

    def peer_aborts(store, gen):
        store.put_if_absent(keys.abort(gen), theirs.stamped(generation=gen).dumps())
    mine = Failure(kind=Kind.LOST.value, container="w_1", observed_by="w_0", reason="lost w_1: its container exited")
    a, store = agent(tmp_path, [(Outcome.OTHER, None, peer_aborts), (Outcome.OWN, mine, peer_aborts),
                                (Outcome.SUCCEEDED, None, None)], instances=2)
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2]
    assert load(store, keys.abort(0)).reason == theirs.reason          # first writer wins
    assert load(store, keys.abort(1)).reason == theirs.reason          # ... even over this agent's own finding


def test_an_external_end_spends_no_restart(tmp_path):
    def master_died(store, gen):
        store.put_if_absent(keys.abort(gen), Failure(kind=Kind.EXTERNAL.value, container="master", external=True,
                                                     reason="the application master died").dumps())
    a, store = agent(tmp_path, [(Outcome.OTHER, None, master_died), (Outcome.OTHER, None, master_died),
                                (Outcome.SUCCEEDED, None, None)], max_restarts=0)
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2]
    a, store = agent(tmp_path / "b", [(Outcome.OWN, crash(), None)], max_restarts=0)
    assert a.run() == 7 and load(store, keys.FAILED).attempts == 1


def test_the_same_failure_in_setup_on_every_rank_is_not_retried(tmp_path):
    setup = crash(code=1, phase="setup", error="ModuleNotFoundError: No module named 'mymod'")

    def rank_recorded(store, gen):                   # launcher.rank writes its line before it exits
        store.put_if_absent(keys.error(gen, 0), Failure(reason=setup.error, error=setup.error, phase="setup").dumps())
    a, store = agent(tmp_path, [(Outcome.OWN, setup, rank_recorded)], max_restarts=3)
    assert a.run() == 1 and a.spawned_gens == [0]
    failed = load(store, keys.FAILED)
    assert failed.retried is False and failed.attempts == 1 and failed.reason.endswith(NOT_RETRIED)


def test_a_setup_failure_found_repeatable_on_the_second_attempt_says_not_retried_again(tmp_path):
    """It said "so it was not retried" after 2 attempts."""
    setup = crash(code=1, phase="setup", error="FileNotFoundError: 'data.txt'")

    def recorded(phase):
        def put(store, gen):
            store.put_if_absent(keys.error(gen, 0), Failure(reason=setup.error, error=setup.error, phase=phase).dumps())
        return put
    a, store = agent(tmp_path, [(Outcome.OWN, crash(), recorded("train")), (Outcome.OWN, setup, recorded("setup"))],
                     max_restarts=3)
    assert a.run() == 1 and a.spawned_gens == [0, 1]
    failed = load(store, keys.FAILED)
    assert failed.attempts == 2 and failed.reason.endswith(NOT_RETRIED_AGAIN), failed.reason


def test_a_filesystem_out_of_reach_is_retried_after_a_growing_wait(tmp_path, monkeypatch):
    """A 10-20 s NameNode outage spent every restart within 3 s: every rank met "cannot reach"
    as the restart began, so it was "not retried again" (an HDFS audit). Now retried as often
    as the job allows, the agents waiting longer before each restart."""
    import launcher.retries
    monkeypatch.setattr(launcher.retries, "STORAGE_BACKOFF_S", 0.3)
    line = ("DataError: cannot reach webhdfs://nn:9870/data/train: HTTPConnectionPool(host='nn', port=9870): Max "
            "retries exceeded (Failed to establish a new connection: [Errno 111] Connection refused)")
    setup = crash(code=1, phase="setup", error=line)

    def recorded(store, gen):
        store.put_if_absent(keys.error(gen, 0), Failure(reason=line, error=line, phase="setup").dumps())
    a, store = agent(tmp_path, [(Outcome.OWN, setup, recorded), (Outcome.OWN, setup, recorded),
                                (Outcome.SUCCEEDED, None, None)], max_restarts=3)
    started = time.monotonic()
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2]
    assert time.monotonic() - started >= 0.3 + 0.6          # 1, then 2 times the backoff
    a, store = agent(tmp_path / "b", [(Outcome.OWN, setup, recorded)] * 3, max_restarts=1)
    assert a.run() == 1 and a.spawned_gens == [0, 1]        # the job's restarts still bound it
    assert load(store, keys.FAILED).attempts == 2
    from launcher.failure import storage_unreachable
    assert storage_unreachable("checkpoint.uri webhdfs://nn:9870/ck: cannot write the checkpoint of step 9 (rank 0): "
                               "Cannot create directory /ck/app_1. Name node is in safe mode.")
    for other in ("RuntimeError: [../gloo/transport/tcp/pair.cc:144] connect [datanode3]:41235: Connection refused",
                  "ConnectionError: HTTPConnectionPool(host='mlflow', port=5000): Max retries exceeded (Failed to "
                  "establish a new connection: [Errno 111] Connection refused)",
                  "DataError: cannot reach webhdfs://nn.typo:9870/d: Failed to establish a new connection: [Errno -2] "
                  "Name or service not known",
                  "DataError: cannot reach hdfs://nn/d: Permission denied"):
        assert not storage_unreachable(other), other          # not retried with waits: a peer, a typo, a right


def test_a_setup_failure_beside_a_rank_that_succeeded_is_judged_at_once(tmp_path):
    """A peer's rank returned early and succeeded, so it records no failure: the failure is
    not every rank's, and the agent says so at once instead of waiting out the grace
    (SETUP_GRACE_S + 5 s) for a record that never comes (and, the peer's agent having
    ended, does not retry)."""
    setup = crash(code=1, phase="setup", error="RuntimeError: Connection closed by peer")

    def recorded(store, gen):
        store.put_if_absent(keys.error(gen, 0), Failure(reason=setup.error, error=setup.error, phase="setup").dumps())
        store.put(keys.done("w_1"), json.dumps({"generation": gen}))
    a, store = agent(tmp_path, [(Outcome.OWN, setup, recorded)], max_restarts=0, instances=2)
    started = time.monotonic()
    assert a.run() == 1 and time.monotonic() - started < 5
    failed = load(store, keys.FAILED)       # not as every rank's failure: as one whose world cannot form again
    assert failed.retried is False and "rank 1 (w_1) had ended (exit 0)" in failed.reason, failed
    assert failed.reason.endswith("so it was not retried (its container ended with it: a new world cannot form "
                                  "without it)"), failed


def test_a_mistake_in_the_jobs_model_or_strategy_is_not_retried_even_in_training(tmp_path):
    """The hypergraph strategy partitions at the first step: a model it cannot place failed
    there as a StrategyError's kin (certain) and was tried max_restarts + 1 times."""
    error = "the hypergraph partitioner cannot place BatchNorm2d (layer 'bn')"
    mistake = dataclasses.replace(crash(code=1, error=error), input_error=True, certain=True)
    a, store = agent(tmp_path, [(Outcome.OWN, mistake, None)], max_restarts=3)
    assert a.run() == 1 and a.spawned_gens == [0]
    failed = load(store, keys.FAILED)
    assert failed.retried is False and failed.attempts == 1 and failed.reason.endswith(CERTAIN), failed.reason


@pytest.mark.parametrize("error", ["RuntimeError: Found no NVIDIA driver on your system. Please check that you "
                                   "have an NVIDIA GPU and installed a driver",
                                   "torch.AcceleratorError: CUDA error: invalid device ordinal"])
def test_a_rank_without_the_cuda_device_its_code_asks_for_is_not_retried_even_in_training(tmp_path, error):
    """A GPU script's .cuda() after a first step on the CPU, or on one rank of several, was
    tried max_restarts + 1 times: no restart gives a container a GPU it lacks."""
    a, store = agent(tmp_path, [(Outcome.OWN, crash(code=1, error=error), None)], max_restarts=3)
    assert a.run() == 1 and a.spawned_gens == [0]
    failed = load(store, keys.FAILED)
    assert failed.retried is False and failed.reason.endswith(NO_DEVICE), failed.reason


def test_a_failure_in_training_is_retried_even_when_it_repeats(tmp_path):
    def rank_recorded(store, gen):
        store.put_if_absent(keys.error(gen, 0), Failure(reason="", error=crash().error, phase="train").dumps())
    a, store = agent(tmp_path, [(Outcome.OWN, crash(), rank_recorded)] * 2 + [(Outcome.SUCCEEDED, None, None)])
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2]


def test_the_same_rank_killed_for_memory_twice_in_a_row_is_not_retried_again(tmp_path):
    """A step too big for its container was killed at step 0 in 4 attempts of 4. One retry
    stays; another rank's kill, or a crash between, starts the count again."""
    def oom(rank=0):
        return Failure(kind=Kind.OOM.value, container=f"w_{rank}", rank=rank, exit_code=-9,
                       reason=f"rank {rank} (w_{rank}) was killed by the kernel: w_{rank} exceeded its memory limit")
    a, store = agent(tmp_path, [(Outcome.OWN, oom(), None)] * 4, max_restarts=3)
    assert a.run() != exitcodes.SUCCEEDED and a.spawned_gens == [0, 1]
    failed = load(store, keys.FAILED)
    assert failed.retried is False and failed.attempts == 2 and failed.reason == f"{oom().reason}; {OOM_AGAIN}"
    a, store = agent(tmp_path / "b", [(Outcome.OWN, oom(), None), (Outcome.OWN, crash(), None),
                                      (Outcome.OWN, oom(), None), (Outcome.SUCCEEDED, None, None)], max_restarts=3)
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2, 3]


def test_the_same_bad_input_twice_in_a_row_in_training_is_not_retried_again(tmp_path):
    """A corrupt page of the data, whose CRC fails at the same step of every attempt, spent
    every restart. Bad data (BadData, `repeats`) found twice by the same rank stops after one
    retry; a plain error, or an unreachable filesystem's, that repeats is still retried."""
    line = "train/part-00001.parquet: corrupt or unreadable Parquet data (CRC checksum verification failed)"
    bad = dataclasses.replace(crash(error=line), input_error=True, repeats=True)
    a, store = agent(tmp_path, [(Outcome.OWN, bad, None)] * 4, max_restarts=3)
    assert a.run() != exitcodes.SUCCEEDED and a.spawned_gens == [0, 1]
    failed = load(store, keys.FAILED)
    assert failed.retried is False and failed.attempts == 2 and failed.reason == f"{bad.reason}; {INPUT_AGAIN}"
    other = dataclasses.replace(bad, error=line.replace("00001", "00002"))
    a, store = agent(tmp_path / "b", [(Outcome.OWN, bad, None), (Outcome.OWN, other, None),
                                      (Outcome.SUCCEEDED, None, None)], max_restarts=3)
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2]
    passing = dataclasses.replace(bad, error=line.replace("CRC checksum verification failed", "Connection reset"),
                                  repeats=None)      # an input error of the filesystem's, twice: retried
    a, store = agent(tmp_path / "c", [(Outcome.OWN, passing, None)] * 2 + [(Outcome.SUCCEEDED, None, None)],
                     max_restarts=3)
    assert a.run() == exitcodes.SUCCEEDED and a.spawned_gens == [0, 1, 2]


def test_a_peer_that_ended_early_is_named_beside_the_collective_it_broke(tmp_path):
    """A DDP script's rank 1 did `sys.exit(0)` in its second epoch: rank 0 failed with gloo's
    "Connection reset by peer", and was named alone, rank 1 shown SUCCEEDED. Nor is it
    retried: w_1's agent has ended, and every restart waited out the rendezvous for it."""
    reset = crash(code=1, error="RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    def peer_left(store, gen):
        store.put(keys.done("w_1"), json.dumps({"generation": gen}))
    not_retried = ("; rank 1 (w_1) had ended (exit 0) in this attempt, and its container with it, so it was not "
                   "retried (a new world cannot form without it)")
    a, store = agent(tmp_path, [(Outcome.OWN, reset, peer_left)] * 2, max_restarts=3, instances=2)
    assert a.run() != exitcodes.SUCCEEDED and a.spawned_gens == [0]     # each restart waited for w_1, then failed
    # the rank that ended leads (gloo's line led, and read as rank 0's own crash), gloo's source path dropped
    assert load(store, keys.FAILED).reason == ("rank 1 (w_1) had ended (exit 0) while the others still ran collectives "
                                               "with it: every rank must run the same steps (then "
                                               + reset.reason.replace("[gloo/transport/tcp/pair.cc:537] ", "") +
                                               "); so it was not retried (its container ended with it: a new world "
                                               "cannot form without it)")
    a, store = agent(tmp_path / "b", [(Outcome.OWN, crash(code=1), peer_left)] * 2, max_restarts=3, instances=2)
    assert a.run() != exitcodes.SUCCEEDED and a.spawned_gens == [0]
    assert load(store, keys.FAILED).reason == crash(code=1).reason + not_retried      # its own bug, not blamed on w_1


def test_a_container_that_starts_after_the_application_failed_starts_no_rank(tmp_path):
    a, store = agent(tmp_path, [])
    store.put(keys.FAILED, Failure(reason="rank 1 failed").dumps())
    assert a.run() == exitcodes.APP_FAILED and a.spawned_gens == []
    assert a.transitions == [("START", "FAILED")]


def test_a_lost_peer_fails_this_container_as_app_failed_not_as_its_own(tmp_path):
    lost = Failure(kind=Kind.LOST.value, container="w_1", observed_by="w_0", reason="lost w_1: its container exited")
    a, store = agent(tmp_path, [(Outcome.OWN, lost, None)], max_restarts=0, instances=2)
    assert a.run() == exitcodes.APP_FAILED
    assert load(store, keys.FAILED).reason == lost.reason


def formed_and_training(store, gen, agent):
    """The world formed, and the rank beat once in training (then falls silent)."""
    store.put(keys.formed(gen), json.dumps({"time": time.time()}))
    with open(agent.heartbeat, "w") as f:
        f.write(f"train {time.time()}")


@pytest.mark.parametrize("stopped", [False, True])
def test_a_rank_whose_heartbeat_goes_stale_is_hung_and_restarted(tmp_path, stopped):
    def before(store, gen, agent):
        formed_and_training(store, gen, agent)
        if stopped and gen == 0:
            os.kill(agent.child.pid, signal.SIGSTOP)
    a, store = agent(tmp_path, [["sleep", "60"], ["true"]], cls=ProcessAgent, before=before,
                     launcher={"heartbeat_timeout": "300ms"})
    started = time.monotonic()
    assert a.run() == exitcodes.SUCCEEDED
    assert time.monotonic() - started < 10
    hung = load(store, keys.abort(0))
    assert (hung.kind, hung.rank, hung.container, hung.generation) == (Kind.HUNG.value, 0, "w_0", 0)
    assert "no progress for" in hung.reason and "in train (limit 0.3s: launcher.heartbeat_timeout)" in hung.reason
    assert ("(process stopped)" in hung.reason) == stopped
    assert a.children[0].poll() == -signal.SIGKILL          # the hung rank was killed, not left behind
    assert load(store, keys.restart(1)).kind == Kind.HUNG.value


def test_a_rank_stopped_before_its_first_report_is_hung_after_heartbeat_timeout(tmp_path):
    """A function of the user's own, stopped (SIGSTOP) 8 s in, before it first reported
    progress: it was judged only after rendezvous_timeout (2 minutes by default), as a rank
    still setting up, and named "in setup" though the user's code ran."""
    def before(store, gen, agent):
        store.put(keys.formed(gen), json.dumps({"time": time.time()}))
        with open(agent.heartbeat, "w") as f:
            f.write(f"setup {time.time()}")
        if gen == 0:
            os.kill(agent.child.pid, signal.SIGSTOP)
    a, store = agent(tmp_path, [["sleep", "60"], ["true"]], cls=ProcessAgent, before=before,
                     launcher={"heartbeat_timeout": "300ms", "rendezvous_timeout": "60s"})
    started = time.monotonic()
    assert a.run() == exitcodes.SUCCEEDED
    assert time.monotonic() - started < 10
    hung = load(store, keys.abort(0))
    assert re.search(r"rank 0 \(w_0\) hung \(process stopped\): no progress for [\d.]+s before its first progress "
                     r"report \(limit 0.3s: launcher.heartbeat_timeout\)", hung.reason), hung.reason


@pytest.mark.parametrize("waiting", [False, True, "mpi4py", "spin"])
def test_a_hung_rank_is_named_with_where_its_main_thread_is(tmp_path, waiting):
    """Before, a silent rank's reason said only "no progress". Its agent now asks the rank
    for its stack (launcher.stacks, SIGUSR1): the reason names the main thread's frame. A
    rank found waiting for its peers (a frame in training/collectives/, torch/distributed/,
    mpi4py/) is given as long again first, so that the rank it waits on (here: asleep in the
    user's code) is the one named: before, every silent rank named itself at once. So is one
    in a call of mpi4py's (`ctx.comm.Barrier()`: C code, no frame of mpi4py's), by its line
    (before, the waiting rank was blamed for the one it waited on). One spinning in the
    user's code is at work (an evaluation on rank 0 alone: test_own_code_failures), hung only after
    BUSY_LIMIT times the limit, said so."""
    where = tmp_path / "code" / ("training/collectives" if waiting is True else "user")
    where.mkdir(parents=True)
    (where / "loop.py").write_text(
        f"import sys, time\nsys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
        "from launcher import stacks\nstacks.enable(sys.argv[1])\n\n\n"
        "def wait_here():\n    while True:\n        time.sleep(0.01)\n\n\n"
        "class Comm:\n    Barrier = staticmethod(time.sleep)\n\n\n"
        "def barrier_here(comm=Comm()):\n    while True:\n        comm.Barrier(0.01)\n\n\n"
        "def sleep_here():\n    while True:\n        time.sleep(0.01)\n\n\n"
        "def spin_here():\n    while True:\n        pass\n\n\n"
        f"{ {True: 'wait_here', 'mpi4py': 'barrier_here', False: 'sleep_here', 'spin': 'spin_here'}[waiting]}()\n")
    cmd = [sys.executable, str(where / "loop.py"), str(tmp_path / "heartbeat") + stacks.SUFFIX]
    a, store = agent(tmp_path, [cmd, ["true"]], cls=ProcessAgent, before=formed_and_training,
                     launcher={"heartbeat_timeout": "300ms"})
    assert a.run() == exitcodes.SUCCEEDED
    hung = load(store, keys.abort(0))
    fn = {True: "wait_here", "mpi4py": "barrier_here", False: "sleep_here", "spin": "spin_here"}[waiting]
    assert re.search(rf"; its main thread is at {re.escape(str(where / 'loop.py'))}:\d+ in {fn}", hung.reason), \
        hung.reason
    assert (", waiting for its peers" in hung.reason) == (waiting in (True, "mpi4py")), hung.reason
    silent = float(hung.reason.split("no progress for ")[1].split("s")[0])
    assert silent >= 0.3 + 0.15 + (0.3 if waiting else 0), hung.reason      # limit, grace (and as long again)
    assert (", at work (CPU) all that time, more than 10 times launcher.heartbeat_timeout" in hung.reason) == \
        (waiting == "spin") and (silent >= 3.0) == (waiting == "spin"), hung.reason
    assert a.children[0].poll() == -signal.SIGKILL


@pytest.mark.parametrize("spins", [True, False])
def test_a_rank_at_work_in_its_setup_is_not_hung_until_three_limits(tmp_path, spins):
    """The busy-cluster test on real YARN failed again: the world formed, and its third rank,
    importing training's modules after it joined (30.8 s on the suite's busy host), was
    judged hung in setup at its 20 s limit (launcher.rendezvous_timeout). A rank at work in
    its setup is waited for, as one importing before it joins is, up to IMPORTING_LIMIT
    limits; one idle there is hung at the limit."""
    from launcher.diagnosis import IMPORTING_LIMIT

    def formed_in_setup(store, gen, agent):
        store.put(keys.formed(gen), json.dumps({"time": time.time()}))
        with open(agent.heartbeat, "w") as f:
            f.write(f"setup {time.time()} joining")
    cmd = [sys.executable, "-c", "while True: pass"] if spins else ["sleep", "60"]
    a, store = agent(tmp_path, [cmd, ["true"]], cls=ProcessAgent, before=formed_in_setup,
                     launcher={"rendezvous_timeout": "1s"})
    assert a.run() == exitcodes.SUCCEEDED
    hung = load(store, keys.abort(0))
    silent = float(hung.reason.split("no progress for ")[1].split("s")[0])
    assert "before its first progress report (limit 1s: launcher.rendezvous_timeout)" in hung.reason, hung.reason
    assert (silent >= IMPORTING_LIMIT * 1.0) == spins, hung.reason


def test_a_rank_found_waiting_leaves_the_hang_to_a_peer_that_beat_after_it(tmp_path):
    """A new user's function: after a barrier rank 1 reported once more, 7 s later, then
    hung. Rank 0, waiting in the next collective since the barrier, was silent 7 s longer
    and named itself hung ("waiting for its peers"), not rank 1. Agents now say in their
    beats how long their rank has been silent; a waiting rank whose peer beat after it
    leaves the naming to that peer's agent. Here the peer's rank beats 2 s after this one
    and its agent names it 2.25 s later (limit 1.5 s and its margin): after this rank's own
    limit, margin and waiting grace (3.75 s), which before ended with this rank named."""
    where = tmp_path / "code" / "training/collectives"
    where.mkdir(parents=True)
    (where / "loop.py").write_text(
        f"import sys, time\nsys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})\n"
        "from launcher import stacks\nstacks.enable(sys.argv[1])\n\n\n"
        "def wait_here():\n    while True:\n        time.sleep(0.01)\n\n\nwait_here()\n")
    cmd = [sys.executable, str(where / "loop.py"), str(tmp_path / "heartbeat") + stacks.SUFFIX]
    theirs = Failure(kind=Kind.HUNG.value, container="w_1", rank=1, reason="rank 1 (w_1) hung: no progress")
    done = threading.Event()

    def peer(store, gen, agent):            # w_1's agent: its rank beat at +2 s, then fell silent
        formed_and_training(store, gen, agent)
        start = time.time()

        def beat():
            n = 0
            while not done.wait(0.1):
                n += 1
                quiet = max(0.0, time.time() - start - 2.0)
                store.put(keys.beat("w_1"), json.dumps({"incarnation": "p", "group": "w", "rank": 1,
                                                          "engine_id": "w_1", "rank_quiet": quiet, "n": n}))
                if quiet > 2.25 and store.get(keys.abort(gen)) is None:
                    store.put_if_absent(keys.abort(gen), theirs.stamped(generation=gen).dumps())
        threading.Thread(target=beat, daemon=True).start()
    a, store = agent(tmp_path, [cmd, ["true"]], cls=ProcessAgent, before=peer, instances=2,
                     launcher={"heartbeat_timeout": "1500ms"})
    try:
        assert a.run() == exitcodes.SUCCEEDED
    finally:
        done.set()
    assert load(store, keys.abort(0)).reason == theirs.reason
    assert a.children[0].poll() is not None


def test_the_main_thread_is_found_in_a_rank_dump_whichever_thread_took_the_signal():
    """A rank runs as `python -m launcher.rank` (runpy outermost); its liveness thread runs
    rank.py's code too. The signal may land on any thread."""
    dump = ('Current thread 0x00007f01 (most recent call first):\n'
            '  File "/w/launcher/rank.py", line 190 in run\n'
            '  File "/usr/lib/python3.11/threading.py", line 1045 in _bootstrap_inner\n'
            '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\n'
            'Thread 0x00007f02 (most recent call first):\n'
            '  File "/w/training/collectives/ring.py", line 205 in wait\n'
            '  File "/w/work/train.py", line 19 in main\n'
            '  File "/w/launcher/rank.py", line 313 in main\n'
            '  File "<frozen runpy>", line 198 in _run_module_as_main\n')
    assert stacks.where(dump) == stacks.Where(frame="/w/training/collectives/ring.py:205 in wait", waiting=True)
    assert stacks.where("") is None and stacks.where("garbage") is None


def test_a_rank_waiting_inside_yarnapp_is_described_from_the_users_own_line():
    """A rank that made a collective call its peers did not (an allreduce on rank 0 alone)
    was described at training/collectives/waits.py, naming none of the user's lines."""
    root, lib = stacks._ROOT, os.path.dirname(os.__file__)
    dump = ('Thread 0x00007f02 (most recent call first):\n'
            f'  File "{root}/training/collectives/waits.py", line 97 in _sleepy\n'
            f'  File "{root}/training/dist.py", line 290 in allreduce_\n'
            '  File "/w/work/train.py", line 42 in <module>\n'
            f'  File "{lib}/runpy.py", line 88 in _run_code\n'
            f'  File "{root}/launcher/rank.py", line 313 in main\n')
    at = stacks.where(dump)
    assert at.waiting and at.describe() == f"/w/work/train.py:42 in <module> (in {root}/training/collectives/" \
                                           f"waits.py:97 in _sleepy)"
    # code the user ran from a string (exec, python -c) is the user's too; Python's and torch.fx's pseudo-files not
    exec_d = dump.replace('"/w/work/train.py", line 42 in <module>', '"<eval_with_key>.0", line 7 in forward\n'
                          '  File "<string>", line 3 in main')
    assert stacks.where(exec_d).caller == "<string>:3 in main", exec_d
    # ... but not where a file of the user's lies further out (a dataclass's generated __init__)
    generated = dump.replace('"/w/work/train.py", line 42 in <module>', '"<string>", line 4 in __init__\n'
                             '  File "/w/work/train.py", line 42 in <module>')
    assert stacks.where(generated).caller == "/w/work/train.py:42 in <module>", generated


def test_a_line_calling_a_communicators_blocking_method_is_waiting_and_others_are_not(tmp_path):
    """mpi4py's methods are C code: `ctx.comm.Barrier()` leaves the user's line innermost.
    The receiver must be named like a communicator: a loss's x.gather(...) computes."""
    code = tmp_path / "train.py"
    lines = ["ctx.comm.Barrier()", "total = MPI.COMM_WORLD.allreduce(n)", "comm.barrier()", "reqs = MPI.Request.Waitall(rs)",
             "picked = logits.gather(1, y[:, None])", "s = functools.reduce(add, xs)", "data = sock.recv(4096)"]
    code.write_text("\n".join(lines) + "\n")
    found = [stacks.where(f'Thread 0x00007f02 (most recent call first):\n  File "{code}", line {i} in main\n'
                          f'  File "/w/launcher/rank.py", line 313 in main\n').waiting for i in range(1, len(lines) + 1)]
    assert found == [True, True, True, True, False, False, False]


def test_a_rank_still_beating_is_not_hung(tmp_path):
    def beating(store, gen, agent):
        formed_and_training(store, gen, agent)
        subprocess.Popen(["sh", "-c", f"for i in 1 2 3 4 5 6 7 8; do sleep 0.1; touch {agent.heartbeat}; done"]).wait()
        agent.child.wait()
    a, store = agent(tmp_path, [["sleep", "0.5"]], cls=ProcessAgent, before=beating, max_restarts=0,
                     launcher={"heartbeat_timeout": "300ms"})
    assert a.run() == exitcodes.SUCCEEDED and store.get(keys.abort(0)) is None


@pytest.mark.parametrize("port, missing", [(True, "w_1, w_2"), (False, "w_0, w_2")])
def test_a_world_that_does_not_form_fails_naming_who_is_missing(port, missing, tmp_path):
    """Ranks that did not join are missing; with rank 0's port not out, rank 0 and those whose
    agent never reported (nobody else could join: before, it named every other rank; then
    rank 0 alone, where YARN had not allocated others either)."""
    def rank0(store, gen, agent):
        store.put(keys.alive("w_1"), json.dumps({"incarnation": "x", "pid": 1, "time": 0}))
        if port:
            store.put(keys.port(gen), "tag#port")
    a, store = agent(tmp_path, [["sleep", "60"]], cls=ProcessAgent, max_restarts=0, instances=3, before=rank0,
                     launcher={"rendezvous_timeout": "300ms"})
    assert a.run() == exitcodes.RANK_FAILED
    failed = load(store, keys.FAILED)
    assert failed.kind == Kind.NOT_FORMED.value and failed.reason.split("missing: ")[1].split(";")[0] == missing, failed.reason
    assert "; w_2 never reported: stuck as it started, or started lately" in failed.reason, failed.reason
    assert a.children[0].poll() == -signal.SIGTERM      # stopped as torchrun stops its workers, not left behind


@pytest.mark.parametrize("importing", ["its own rank", "a peer's"])
def test_a_world_waits_for_a_rank_at_work_importing_then_fails_naming_it(importing, tmp_path):
    """The busy-cluster test on real YARN failed: the job's third container, started when
    another tenant's left, was still importing (53 s on the suite's busy host) when the
    rendezvous limit (40 s) ran out, and the world "did not form". A rank at work in its
    start (using CPU, not yet joining: its own, or a peer's as that one's agent beats) is
    waited for, up to IMPORTING_LIMIT limits; one idle there fails at the limit (above)."""
    from launcher.diagnosis import IMPORTING_LIMIT
    spin = [sys.executable, "-c", "while True: pass"]
    stop = threading.Event()

    def peer_importing(store, gen, agent):
        def beat(n=0):
            while not stop.is_set():
                n += 1
                store.put(keys.beat("w_1"), json.dumps({"incarnation": "x", "group": "w", "rank": 1,
                                                        "engine_id": "w_1", "rank_importing": True, "n": n}))
                time.sleep(0.2)
        threading.Thread(target=beat, daemon=True).start()
    own = importing == "its own rank"
    a, store = agent(tmp_path, [spin if own else ["sleep", "60"]], cls=ProcessAgent, max_restarts=0,
                     instances=1 if own else 2, before=None if own else peer_importing,
                     launcher={"rendezvous_timeout": "1s"})
    t0 = time.monotonic()
    try:
        assert a.run() == exitcodes.RANK_FAILED
    finally:
        stop.set()
    took = time.monotonic() - t0
    failed = load(store, keys.FAILED)
    assert failed.kind == Kind.NOT_FORMED.value and took >= IMPORTING_LIMIT * 1.0, (took, failed.reason)
    who = "w_0" if own else "w_1"
    assert f"; {who} still at work importing its code after {IMPORTING_LIMIT} times the limit" in failed.reason, \
        failed.reason
    assert a.children[0].poll() is not None


def test_a_rank_that_crashes_is_restarted_and_its_status_is_the_containers(tmp_path):
    a, store = agent(tmp_path, [["sh", "-c", "exit 5"], ["sh", "-c", "exit 6"]], cls=ProcessAgent, max_restarts=1)
    assert a.run() == 6                                   # its rank's status in the last generation
    failed = load(store, keys.FAILED)
    assert (failed.kind, failed.exit_code, failed.attempts) == (Kind.CRASHED.value, 6, 2)
    assert failed.reason == "rank 0 (w_0) exited with status 6"
    assert load(store, keys.restart(1)).exit_code == 5


def test_the_transitions_drawn_on_the_states_are_the_ones_the_agent_takes():
    drawn, source = set(), None
    for line in State.__doc__.splitlines():
        words = line.split()
        if "→" not in words:
            continue
        if words[0] != "→":
            source = State[words[0]]
        drawn.add((source, State[words[words.index("→") + 1]]))
    assert drawn == {(a, b) for a, nexts in TRANSITIONS.items() for b in nexts}
    assert set(TRANSITIONS) == set(State)


def test_the_record_reads_back_what_was_written_and_ignores_what_it_does_not_know():
    wire = json.dumps({"reason": "rank 1 (w_1) hung", "kind": "hung", "rank": 1, "generation": 2, "future": 1})
    f = Failure.load(wire)
    assert (f.kind, f.rank, f.generation, f.external, f.exit_code) == ("hung", 1, 2, False, None)
    assert Failure.record(wire) == {"reason": "rank 1 (w_1) hung", "kind": "hung", "rank": 1, "generation": 2}
    assert Failure.load(f.dumps()) == f and Failure.record(None) is None and Failure.load(b"{}") is None


# -- collateral or cause: the real monitor over a real rank process ------------------

def watched(tmp_path, code):
    """A plain Agent (rank 0 of 2, generation 0, the world formed with w_1 alive) whose rank
    process runs `code`."""
    a, store = agent(tmp_path, [], instances=2)
    a = Agent(a.ident, store)
    w1 = "peer-incarnation"
    store.put(keys.port(0), "port")
    store.put(keys.joined(0, 1), "1")
    store.put(keys.incarnation(0, 1), w1)
    store.put(keys.formed(0), "{}")
    store.put(keys.alive("w_1"), json.dumps({"incarnation": w1}))
    a.memory_before = memory.state(a.cgroup)
    a.child = subprocess.Popen([sys.executable, "-c", code])
    a.spawned = time.monotonic()
    a._phase = "train"
    return a, store


def test_a_rank_that_aborts_after_its_peer_died_names_the_peer_the_rm_reports_late(tmp_path):
    """rank 1's container died with its agent (nobody writes its abort); rank 0 dies of MPI's
    SIGABRT at once, but YARN drops w_1's alive key only a moment later: the cause is w_1."""
    a, store = watched(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGABRT)")
    store.death_notice_s = SkeinStore.death_notice_s      # a store that hears of dead containers as YARN does
    threading.Timer(1.5, lambda: store.delete(keys.alive("w_1"))).start()
    outcome, failure = a.monitor(0)
    assert outcome is Outcome.OWN
    assert failure.kind == Kind.LOST.value and failure.container == "w_1", failure
    assert failure.observed_by == "w_0"


def test_on_the_local_engine_a_rank_that_died_alone_is_named_without_waiting_for_yarns_delay(tmp_path):
    """The local master hears of a dead container within its 50 ms poll: a peer container
    that goes 3 s after this rank died (no error line: os._exit) is another matter, and this
    rank is named (on YARN, 6 s of grace would name the peer: the test above)."""
    a, store = watched(tmp_path, "import os; os._exit(99)")
    a.child.wait()
    later = threading.Timer(FileStore.death_notice_s + 2, lambda: store.delete(keys.alive("w_1")))
    later.start()
    try:
        outcome, failure = a.monitor(0)
    finally:
        later.cancel()
    assert outcome is Outcome.OWN
    assert failure.kind == Kind.CRASHED.value and failure.rank == 0 and "status 99" in failure.reason, failure


def test_a_peers_setup_failure_is_waited_on_briefly_once_the_world_formed_longer_on_fewer_vcores(tmp_path):
    """Before the world formed, ranks start seconds apart: SETUP_GRACE_S. After, 1 s plus a
    multiple of the time since it formed: 3, or the job's largest container's vcores over
    this one's (4 over 0.5: 8), at most SETUP_GRACE_S."""
    job = conf.load_job({"name": "grace", "run": {"function": "training.hello:main"},
                         "groups": [{"name": "big", "instances": 1, "vcores": 4},
                                    {"name": "small", "instances": 1, "vcores": 0.5}]})
    os.makedirs(tmp_path, exist_ok=True)
    grace = {}
    for rank, group in enumerate(("big", "small")):
        ident = Identity(backend="local", app_id="a", container=f"{group}_0", group=group, instance=0, rank=rank,
                         job=job, secret="s", app_dir=str(tmp_path))
        a = Agent(ident, FileStore(str(tmp_path / "store")))
        assert a.setup_grace() == SETUP_GRACE_S                    # the world has not formed
        a.formed_seen = time.monotonic() - 0.5
        grace[group] = a.setup_grace()
        a.formed_seen = time.monotonic() - 60
        assert a.setup_grace() == SETUP_GRACE_S
    assert 1 + 3 * 0.5 <= grace["big"] < 1 + 3 * 0.5 + 0.2, grace
    assert 1 + 8 * 0.5 <= grace["small"] < 1 + 8 * 0.5 + 0.2, grace


def test_a_rank_that_raised_its_own_error_is_the_cause_even_if_a_peer_then_goes(tmp_path):
    a, store = watched(tmp_path, "import sys; sys.exit(1)")
    store.put(keys.error(0, 0), json.dumps({"error": "ValueError: bad label 11", "phase": "train"}))
    # the peer goes after the rank's end and the second its agent waits for a cause (at 1.5 s, a
    # loaded CI host's interpreter start left less than that second: the peer was named)
    threading.Timer(3.0, lambda: store.delete(keys.alive("w_1"))).start()
    outcome, failure = a.monitor(0)
    assert outcome is Outcome.OWN
    assert failure.kind == Kind.CRASHED.value and failure.rank == 0, failure
    assert "ValueError: bad label 11" in failure.reason


def test_a_peer_whose_agent_falls_silent_is_named_and_its_replacement_asked_for_once(tmp_path):
    """A peer's beat that stops changing (its whole container stopped) ends the generation
    naming that peer, not this rank, and asks for its replacement (launcher.keys.replace),
    once: in the next generation the same silent incarnation is not judged again. Two
    peers frozen together (one host) are both replaced at once, not one restart each."""
    def before(store, gen, agent):
        if gen == 0:
            for c in ("w_1", "w_2"):
                store.put(keys.beat(c), json.dumps({"incarnation": f"i{c[-1]}", "engine_id": c, "group": "w", "n": 7}))
    a, store = agent(tmp_path, [["sleep", "60"], ["true"]], cls=ProcessAgent, before=before, instances=3)
    a.peers.limit = 0.3
    started = time.monotonic()
    assert a.run() == exitcodes.SUCCEEDED
    assert time.monotonic() - started < 10
    lost = load(store, keys.abort(0))
    assert (lost.kind, lost.container, lost.observed_by) == (Kind.LOST.value, "w_1", "w_0"), lost
    assert "stopped responding" in lost.reason and "launcher.heartbeat_timeout" in lost.reason
    assert "(and w_2, silent too)" in lost.reason, lost.reason
    assert json.loads(store.get(keys.replace("w_1", "i1")))["by"] == "w_0"
    assert json.loads(store.get(keys.replace("w_2", "i2")))["by"] == "w_0"
    assert a.children[0].poll() == -signal.SIGTERM and store.get(keys.abort(1)) is None   # (SIGTERM: not hung)


def test_a_rank_waiting_in_vain_on_a_silent_peer_names_the_peer_not_itself(tmp_path, monkeypatch):
    """This rank stops making progress, and a peer's beat has been still for a while
    (beats.SUSPECT_S), though not yet for the frozen limit: the silent peer is the cause."""
    monkeypatch.setattr(beats, "SUSPECT_S", 0.2)

    def before(store, gen, agent):
        if gen == 0:
            store.put(keys.beat("w_1"), json.dumps({"incarnation": "i1", "engine_id": "w_1", "group": "w", "n": 1}))
            formed_and_training(store, gen, agent)
    a, store = agent(tmp_path, [["sleep", "60"], ["true"]], cls=ProcessAgent, before=before, instances=2,
                     launcher={"heartbeat_timeout": "300ms"})
    a.peers.limit = 60
    assert a.run() == exitcodes.SUCCEEDED
    lost = load(store, keys.abort(0))
    assert (lost.kind, lost.container) == (Kind.LOST.value, "w_1") and "stopped responding" in lost.reason, lost
    assert store.get(keys.replace("w_1", "i1")) is not None


def test_a_watcher_whose_own_beat_is_stale_judges_nobody():
    """A stalled store stills every beat at once: each agent would name another. An agent
    judges its peers only while it sees its own beat change."""
    watch = beats.Watch([{"container": "a"}, {"container": "b"}], "a", limit=10)
    snap = lambda na, nb: {keys.beat("a"): json.dumps({"incarnation": "x", "n": na}).encode(),   # noqa: E731
                           keys.beat("b"): json.dumps({"incarnation": "y", "n": nb}).encode()}
    watch.update(snap(1, 1), now=0.0)
    assert watch.frozen(snap(1, 1), now=20.0) == []         # every beat still for 20 s: the store stalled
    assert watch.frozen(snap(2, 1), now=20.5) == []         # a's beat moves again; b's silence counts from here
    assert [watch.frozen(snap(n, 1), now=float(n)) for n in range(21, 31)] == [[]] * 10
    assert watch.frozen(snap(31, 1), now=31.0)[0][0] == "b"  # b still for 10.5 s of a fresh own beat: frozen
    assert watch.frozen(snap(31, 1), now=40.0) == []        # a's own beat still for 9 s: nobody judged


def test_a_frozen_peer_that_spends_the_last_restart_fails_the_job_and_is_not_replaced(tmp_path):
    """With no restart left, the line does not promise a replacement, none is asked for,
    and the failure carries no log of this (healthy) container."""
    def before(store, gen, agent):
        store.put(keys.beat("w_1"), json.dumps({"incarnation": "i1", "engine_id": "w_1", "group": "w", "n": 1}))
    a, store = agent(tmp_path, [["sleep", "60"]], cls=ProcessAgent, before=before, instances=2, max_restarts=0)
    a.peers.limit = 0.3
    assert a.run() == exitcodes.APP_FAILED             # this container is fine; the job failed
    failed = load(store, keys.FAILED)
    assert failed.container == "w_1" and "stopped responding" in failed.reason, failed
    assert "replace" not in failed.reason and not failed.log, failed
    assert store.get_prefix(keys.REPLACE_PREFIX) == {}


def test_a_rank_whose_code_ended_early_stops_waiting_for_its_peers_once_their_generation_is_aborted(tmp_path):
    """The end of code on torch.distributed (launcher.rank.meet_at_the_end) waits for every
    rank to finish, up to its limit. Once the generation is aborted (a peer failed on the
    closed group) nobody else will finish: it waited out the limit (10 s) before the
    failure was reported; now it leaves at once. Without an abort it waits for the others."""
    from launcher.failure import caused_by_an_end
    from launcher.rank import ABORTED, WAITED, meet_at_the_end
    store = FileStore(str(tmp_path / "store"))
    t0 = time.monotonic()
    assert meet_at_the_end(store, 0, 1, 3, wait=1.0) == WAITED
    assert time.monotonic() - t0 >= 1.0                              # the others never finished
    assert store.get(keys.finished(0, 1)) == b"left"         # (ranks on the MPI world skip the Barrier)
    crash = Failure(kind=Kind.CRASHED.value, container="big_0", rank=0, reason="rank 0 (big_0) exited with status 1")
    store.put(keys.abort(1), crash.dumps())
    t0 = time.monotonic()
    assert meet_at_the_end(store, 1, 1, 3, wait=60.0) == ABORTED
    assert time.monotonic() - t0 < 30.0                              # left on the abort, not at the limit
    # Its end caused the abort (the peers lost it, or waited for it): it leaves with 0, the rank
    # that ended early (not retried); a peer's own crash: it leaves non-zero, and the restart is owed.
    assert not caused_by_an_end(crash)
    assert caused_by_an_end(Failure(kind=Kind.CRASHED.value, rank=0, reason="rank 0 (big_0) exited with status 1",
                                    error="RuntimeError: Connection closed by peer [127.0.0.1]:29500"))
    assert caused_by_an_end(Failure(kind=Kind.HUNG.value, rank=0, reason="rank 0 (w_0) waited 15s in a collective "
                                    "at e.py:5 for rank 1 (w_1), whose code had finished: it ran fewer steps"))


@pytest.mark.parametrize("how", ["env", "store"])
def test_code_that_destroyed_its_own_process_group_counts_as_code_on_torch_distributed(tmp_path, how):
    """The DDP tutorial's destroy_process_group() before the end: its rank still leaves without
    waiting for its peers (a DDP model holds the group's sockets); with init_process_group(
    store=...) too, which leaves torch's init method unset (a review)."""
    init = ("dist.init_process_group('gloo')" if how == "env" else
            "dist.init_process_group('gloo', store=dist.TCPStore('127.0.0.1', 0, 1, True), rank=0, world_size=1)")
    code = ("import os, socket, torch.distributed as dist\nfrom launcher.rank import close_user_process_group\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); os.environ['MASTER_PORT'] = str(s.getsockname()[1])\n"
            "s.close()\n"
            "print(close_user_process_group())\n" + init + "\ndist.destroy_process_group()\n"
            "print(close_user_process_group())\n")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], (out.stdout, out.stderr)


def test_the_run_context_knows_whether_code_read_the_mpi_world():
    """launcher.rank lets a rank leave without waiting for its peers when its code never
    read ctx.comm (it is in none of their MPI calls): reading it, even once, counts."""
    from training.context import RunContext
    ctx = RunContext(comm="the world", rank=0, world_size=2, ranks=[], job=None, app_id="a", generation=0,
                     workdir=".", checkpoint_uri="", logdir="")
    ctx.comm_used = False
    ctx.heartbeat("setup")
    assert ctx.rank == 0 and ctx.restart_count == 0 and not ctx.comm_used
    assert ctx.comm == "the world" and ctx.comm_used


def test_a_users_error_line_says_where_their_code_raised_it_and_keeps_every_line(tmp_path):
    """`assert x == 4` in a user's function said only "AssertionError: "; a message of several
    lines kept its first ("ValueError: shape mismatch:")."""
    from launcher.user_errors import error_line
    (tmp_path / "user_code_mod.py").write_text("def step(x):\n    assert x == 4\n\n\ndef shape():\n"
                                               "    raise ValueError('shape mismatch:\\n  expected (3, 8, 8)\\n"
                                               "  got (1, 8, 8)')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import user_code_mod
        for call, want in ((lambda: user_code_mod.step(3), "AssertionError (user_code_mod.py:2 in step)"),
                           (user_code_mod.shape, "ValueError: shape mismatch: expected (3, 8, 8) got (1, 8, 8) "
                                                 "(user_code_mod.py:6 in shape)")):
            with pytest.raises(Exception) as e:
                call()
            assert error_line(e.value) == want
        with pytest.raises(KeyError) as e:          # raised inside the environment: the user's frame above it
            user_code_mod.__dict__["missing"]
        assert error_line(e.value).startswith("KeyError: 'missing' (test_agent_states.py:")
    finally:
        sys.path.remove(str(tmp_path))
    # a DataLoader worker's error, which torch wraps with the worker's traceback in its text:
    # the line kept torch's first 300 characters, the cause past them, and named the for loop
    (tmp_path / "user_ds_mod.py").write_text(
        "import torch\n\n\nclass DS(torch.utils.data.Dataset):\n    def __len__(self):\n        return 40\n\n"
        "    def __getitem__(self, i):\n        if i == 37:\n            raise ValueError('corrupt sample 37')\n"
        "        return torch.zeros(2)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import torch
        import user_ds_mod
        with pytest.raises(ValueError) as e:
            for _ in torch.utils.data.DataLoader(user_ds_mod.DS(), batch_size=10, num_workers=1):
                pass
        assert error_line(e.value) == "ValueError: Caught ValueError in DataLoader worker process 0: ValueError: " \
                                      "corrupt sample 37 (user_ds_mod.py:10 in __getitem__)"
    finally:
        sys.path.remove(str(tmp_path))


def test_ranks_in_calls_of_the_same_number_and_different_names_are_named_and_a_silent_one_after_a_grace():
    """launcher.diagnosis.called_apart on the records training.stalls publishes: the same call
    number everywhere is no verdict (a slow peer), a conflict is, naming every rank; a rank
    that has said nothing is named "elsewhere" once APART_GRACE_S has passed."""
    from types import SimpleNamespace

    from launcher import diagnosis

    class Judge(diagnosis.PeerDiagnosis):
        def __init__(self, rank):
            self.ident = SimpleNamespace(rank=rank, container=f"w_{rank}")
            self.members = [{"rank": r, "container": f"w_{r}"} for r in range(3)]

    def seen(*records):
        return {keys.stall(0, r): json.dumps(rec) for r, rec in records}

    waiting = {"call": 4, "name": "allreduce", "at": "train.py:9 in main"}
    same = seen((0, waiting), (1, waiting), (2, waiting))
    assert Judge(0).called_apart(0, same) is None
    left = seen((0, {"call": 4, "name": "barrier", "at": "train.py:7 in main"}), (1, waiting),
                (2, {"call": 4, "name": None}))
    judge = Judge(0)
    assert judge.called_apart(0, left) is None              # rank 2 may still say where it waits
    assert Judge(2).called_apart(0, left) is None           # a rank not found waiting does not judge
    judge.apart_since -= diagnosis.APART_GRACE_S
    f = judge.called_apart(0, left)
    assert f.kind == Kind.HUNG.value and f.reason == (
        "the ranks wait in different collectives of training.dist, which never meet: rank 0 (w_0) in barrier "
        "(call 4 of training.dist, at train.py:7 in main); rank 1 (w_1) in allreduce (call 4 of training.dist, "
        "at train.py:9 in main); rank 2 (w_2) elsewhere; every rank must call them in the same order (one made "
        "under `if rank == 0:`, or after a rank ran more steps than the others?)"), f.reason
    assert judge.apart_since is None


def test_a_sys_exit_is_said_where_it_was_called_beside_the_last_line_on_stderr(tmp_path):
    """`sys.exit(3)` on one rank read `exited with status 3: stderr hello from 1`, a line the
    script printed at its start, as if it were the reason: where the code exited now leads."""
    from launcher.user_errors import exit_line
    script = tmp_path / "train.py"
    script.write_text("import sys\n\n\ndef main():\n    sys.exit(3)\n")
    scope = {}
    exec(compile(script.read_text(), str(script), "exec"), scope)
    with pytest.raises(SystemExit) as exited:
        scope["main"]()
    assert exit_line(exited.value, "hello from 1") == "sys.exit(3) at train.py:5 in main; its last line on stderr: " \
                                                      "hello from 1"
    assert exit_line(exited.value, "") == "sys.exit(3) at train.py:5 in main"
    assert exit_line(SystemExit("lr too high"), "hello") == "lr too high"      # sys.exit("...") says it itself
    assert exit_line(SystemExit(4), "") == "exited with status 4"


def test_a_long_error_line_keeps_its_start_and_its_advice(tmp_path):
    """A rank's line was cut at 500 characters mid-word: an HDFS error's "[Errno" was its end,
    the cause ("111] Connection refused") and what to do lost (an HDFS audit)."""
    from launcher.rank import ERROR_LINE_CHARS, record_error
    store = FileStore(str(tmp_path / "store"))
    line = ("checkpoint.uri webhdfs://nn:9870/ckpt: cannot write the checkpoint of step 340 (rank 0): "
            + "HTTPConnectionPool(host='nn', port=9870): Max retries exceeded " * 12
            + "[Errno 111] Connection refused; free space or fix its permissions (the checkpoint before it is intact)")
    record_error(store, 0, 0, line, "train")
    said = Failure.load(store.get(keys.error(0, 0))).error
    assert len(said) <= ERROR_LINE_CHARS and said.startswith(line[:200]), said
    assert said.endswith("[Errno 111] Connection refused; free space or fix its permissions (the checkpoint before "
                         "it is intact)") and " [...] " in said, said


def test_a_world_not_formed_on_an_overloaded_host_says_so():
    """An automation audit: ten jobs submitted at once on two cores failed "world not formed
    within 120s; missing: small_0, small_1", saying nothing of the 30 ranks importing torch on
    two cores, nor of the limit to raise."""
    from launcher.diagnosis import overload_note
    assert overload_note(load=14.2, cores=2) == (
        "; this host was overloaded (load average 14.2 on 2 cores), so its ranks started slowly: run fewer jobs at "
        "once, or raise launcher.rendezvous_timeout")
    assert overload_note(load=3.9, cores=2) == "" and overload_note(load=0.5) == ""


def test_a_ranks_logged_failure_line_is_read_only_from_its_fail(tmp_path):
    """Where a rank could not record its line in the store, its agent reads the line its
    fail() logged; a review: any launcher.rank line was taken ("exited with status 1: world
    generation 0 formed ..."), where a rank that exits 1 otherwise is described by its own."""
    from launcher.failure import ERROR_LINE_CHARS, logged_error
    log = tmp_path / "container.log"
    log.write_text("2026-11-30 14:17:15,600 rank1 w_1 launcher.rank: world generation 0 formed: rank 1 of 2\n"
                   "Traceback (most recent call last):\nRuntimeError: boom\n")
    assert logged_error(str(log)) == ""
    with open(log, "a") as f:
        f.write("2026-11-30 14:17:15,621 rank1 w_1 launcher.rank.failed: part-0.parquet: too many open files\n"
                "2026-11-30 14:17:15,622 rank1 w_1 launcher.rank: something after\n")
    assert logged_error(str(log)) == "part-0.parquet: too many open files"
    assert logged_error(str(log), offset=log.stat().st_size) == ""          # (a later generation's start)
    with open(log, "a") as f:
        f.write("2026-11-30 14:17:16,000 rank1 w_1 launcher.rank.failed: " + "x" * 5000 + "\n")
    assert len(logged_error(str(log))) <= ERROR_LINE_CHARS

