"""The performance model's vocabulary: what a rank's compute, the link and the CPUs are.

    Layer, Profile   a model's measured compute at one batch on one device and thread
                     count (training.planner.profile measures them)
    Device           a rank: a Profile divided by speed × quota (a container of v vcores
                     running k threads gets q = v/k of k cores)
    Link             one-way time of m bytes α + m/β
    Scheduling       how the ranks get their CPUs (shared cores, CFS period) and what a
                     polite wait costs; plays a step out under quotas (quota_sim)
    Case             one cluster running one job: what every cost model is given

The strategies' cost models (training.strategies.<name>.cost) predict a step from a
Case; the planner (training.planner) measures the numbers and presents the results.
"""
import dataclasses
from typing import Optional

from conf.errors import YarnappError

from . import quota_sim

DEFAULT_LATENCY_S = 50e-6          # a given --bandwidth without --latency: a LAN's one-way delay


class PlanError(YarnappError, ValueError):
    """A plan that cannot be made. str() is one line saying what to give instead."""


@dataclasses.dataclass
class Layer:
    """One leaf module call at batch B: forward + backward seconds and its tensors."""
    name: str
    kind: str                     # "conv" (nn.Conv2d), "linear" or "other"
    seconds: float
    params: int
    param_bytes: int
    in_bytes: int                 # |X| of the call
    out_bytes: int                # |Y|
    out_channels: int             # convs: kernels C; else 0
    needs_input_grad: bool        # an earlier layer needs dX
    distributable: bool           # a conv DistributedConv2d can split
    chain_s: float = 0.0          # convs: the channel-wise layers right after it (conv-MP runs them in the shards)
    chain_out_bytes: int = 0      # ... and their output's bytes (what is gathered then); 0 = no chain
    feeds: str = ""               # convs: the conv its output (after the chain) goes to alone (a conv-MP link)
    head: str = ""                # convs: the Linear its flattened output goes to alone, run row-parallel by
                                  # conv-MP (counted in chain_s and chain_out_bytes, its parameters in head_bytes)
    head_bytes: int = 0


@dataclasses.dataclass
class Profile:
    """Compute of one model at batch `batch` with `threads` threads on `device` (seconds)."""
    device: str
    threads: int
    batch: int
    layers: list
    step_s: float                 # t(B): whole forward + loss + backward
    intercept_s: float            # a of the affine fit t(b) = a + (t(B) − a) b / B
    optimizer_s: float            # one optimizer step over every parameter
    params: int
    param_bytes: int
    rows_s: dict = dataclasses.field(default_factory=dict)     # {rows: t(rows)} measured
    shares_s: dict = dataclasses.field(default_factory=dict)   # {"layer/kernels": seconds} measured
    idle_s: float = 0.0           # rows_s and shares_s timed after this long an idle pause each
    kernel_block: int = 1         # conv kernels computed as one vector block (conv_mp.calibrate.kernel_block)

    def fwd_bwd_s(self, rows):
        """t(rows): 0 for no rows, measured where it was (measure_rows), else the affine fit."""
        if rows <= 0:
            return 0.0
        if rows in self.rows_s:
            return self.rows_s[rows]
        return self.intercept_s + (self.step_s - self.intercept_s) * rows / self.batch

    def share_s(self, name, kernels, chain=False):
        """Forward + backward of `kernels` of layer `name`'s kernels: measured where it was
        (measure_shares), else that fraction of the whole layer's time; `chain`: with
        that fraction of the channel-wise layers after it (Layer.chain_s)."""
        if kernels <= 0:
            return 0.0
        calls = self.layer(name)
        fraction = kernels / calls[0].out_channels
        key = f"{name}/{kernels}"
        own = self.shares_s[key] if key in self.shares_s else fraction * sum(lay.seconds for lay in calls)
        return own + (fraction * sum(lay.chain_s for lay in calls) if chain else 0.0)

    def layer(self, name):
        found = [lay for lay in self.layers if lay.name == name]
        if not found:
            raise PlanError(f"layer {name!r} is not called in the model's forward pass")
        return found

    def as_dict(self):
        return dataclasses.asdict(self)




@dataclasses.dataclass(frozen=True)
class Device:
    """A rank's compute: the Profile's seconds divided by speed × quota.

    speed: a device factor (1 for the profile's own device; a simulated GPU's factor);
    quota: v/k for a container of v vcores running k threads (< 1: CPU-throttled).
    `full=True` gives the times at full speed (÷ speed only): what the rank computes
    between two stops of its quota (quota_sim)."""
    name: str
    profile: Profile
    speed: float = 1.0
    vcores: float = 1.0
    quota: float = 1.0
    idle: Optional[Profile] = None    # rows and shares timed after idle pauses (`idle_profile`)

    @property
    def factor(self):
        return self.speed * self.quota

    def _after_idle(self, waits):
        return self.idle if waits and self.idle is not None else self.profile

    def _per(self, full):
        return self.speed if full else self.factor

    def fwd_bwd_s(self, rows, full=False):
        """A throttled rank waits politely (it sleeps), so it computes after idle pauses."""
        return self._after_idle(self.quota < 1.0).fwd_bwd_s(rows) / self._per(full)

    def layer_s(self, name):
        return sum(lay.seconds for lay in self.profile.layer(name)) / self.factor

    def share_s(self, name, kernels, full=False, chain=False):
        """A throttled rank waits politely (it sleeps), so it computes after idle pauses."""
        return self._after_idle(self.quota < 1.0).share_s(name, kernels, chain) / self._per(full)

    def chain_s(self, name):
        return sum(lay.chain_s for lay in self.profile.layer(name)) / self.factor

    def optimizer_s(self, fraction=1.0, full=False):
        return self.profile.optimizer_s * fraction / self._per(full)

    def sim_rank(self, sched):
        """This device as quota_sim sees it: a throttled rank waits politely and burns
        sched.wait_cpu of its speed while it waits, any other spins."""
        polite = self.quota < 1.0
        return quota_sim.Rank(quota=self.quota, threads=self.profile.threads, weight=self.vcores,
                              wait_cpu=sched.wait_cpu if polite else 1.0,
                              wait_s=sched.wait_s if polite else 0.0)

    @property
    def step_s(self):
        """The whole batch on this device alone: forward, backward, optimizer."""
        return self.fwd_bwd_s(self.profile.batch) + self.optimizer_s()


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """How the ranks get their CPUs: `cores` they share (the local engine: this
    machine's; None: each container has its own, as on YARN), the CFS period of their
    quotas, and what a polite wait costs in CPU: `wait_s` for each wait plus `wait_cpu`
    of a CPU while it lasts plus `byte_s` per byte it receives (`measure_wait_cpu`; here
    ~0.3 ms, ~0.1 and ~0.2 ns)."""
    cores: Optional[int] = None
    wait_s: float = 0.3e-3
    wait_cpu: float = 0.1
    byte_s: float = 0.0
    period_s: float = quota_sim.PERIOD_S

    def step_s(self, devices, phases, syncs, waits):
        """quota_sim's mean step of `devices` running `phases` (full-speed seconds per
        rank) each ended by the synchronisation in `syncs`, with waits[k] waits in phase k."""
        ranks = [d.sim_rank(self) for d in devices]
        return quota_sim.step_s(phases, syncs, ranks, self.cores, self.period_s, waits=waits)


def share_weights(devices, shares):
    """One weight per rank for `shares` (equal | vcores | speed | a list), as the strategies
    weigh them; 'speed' is rows per second of each device's forward + backward on the
    whole batch (the ranks time theirs on their own shares, training.strategies.shares:
    the same where a device's rows/s does not depend on how many rows it is given)."""
    from training.data.order import given_weights
    try:
        given = given_weights(shares, [d.vcores for d in devices])
    except ValueError as e:
        raise PlanError(str(e)) from None
    if given is not None:
        return given
    return [1.0 / d.fwd_bwd_s(d.profile.batch) for d in devices]



@dataclasses.dataclass(frozen=True)
class Link:
    """One-way time of m bytes: latency_s + m / bandwidth_Bps."""
    latency_s: float
    bandwidth_Bps: float          # bytes per second
    source: str = "given"
    idle_latency_s: Optional[float] = None   # where latency_s was measured with the CPUs busy
    shared_Bps: Optional[float] = None       # ranks on one host: the shared-memory all-reduce's
                                             # algorithm bandwidth (training.collectives.shm)

    @property
    def bandwidth_bps(self):
        return 8.0 * self.bandwidth_Bps

    def between_machines(self):
        """The link as separate machines would see it: without this machine's CPU contention
        and without shared memory (simulated clusters put every rank on a machine of its own)."""
        if self.idle_latency_s is None and self.shared_Bps is None:
            return self
        if self.idle_latency_s is None:
            return Link(self.latency_s, self.bandwidth_Bps, self.source)
        return Link(self.idle_latency_s, self.bandwidth_Bps, self.source + "; idle latency")

    def seconds(self, nbytes):
        return self.latency_s + nbytes / self.bandwidth_Bps

    def as_dict(self):
        out = {"latency_s": self.latency_s, "bandwidth_bps": self.bandwidth_bps, "source": self.source}
        if self.shared_Bps:
            out["shared_memory_Bps"] = self.shared_Bps
        return out


def link_from_rate(bps, latency_s=None, source="given"):
    """A Link of `bps` bits per second (and DEFAULT_LATENCY_S unless given)."""
    return Link(DEFAULT_LATENCY_S if latency_s is None else float(latency_s), float(bps) / 8.0, source)



def prediction(strategy, devices, step_s, compute_s, comm_s, split, **extra):
    """A cost model's result: step, compute and communication seconds, the speedup over
    rank 0's device alone, the split (rows or kernels per rank) and any `extra` fields."""
    single = devices[0].step_s
    return dict({"strategy": strategy, "ranks": len(devices), "step_s": step_s, "compute_s": compute_s,
                 "comm_s": comm_s, "speedup": single / step_s, "split": split}, **extra)


def per_rank(own, n):
    """One own-CPU figure per rank from (rank 0's, the others'); a single rank has none
    (no exchange, no protocol)."""
    return [own[0] if r == 0 else own[1] for r in range(n)] if n > 1 else [0.0]


@dataclasses.dataclass(frozen=True)
class Case:
    """One cluster running one job, as every cost model sees it: the devices (rank 0
    first: the master or server), the link, the global batch and its `shares` (equal |
    vcores | speed | a list), how the CPUs are scheduled, the distributed conv layers
    (conv-layer model parallelism), and the strategies' own CPU per step, {strategy:
    (rank 0's, the others')} (measured by the planner's strategy probe; none: 0)."""
    devices: list
    link: Link
    batch: int
    shares: object = "equal"
    sched: Scheduling = Scheduling()
    conv_layers: tuple = ()
    own: dict = dataclasses.field(default_factory=dict)

    def own_cpu(self, strategy):
        """(rank 0's, the others') own CPU seconds per step of `strategy` (None counts as 0)."""
        return tuple(float(v or 0.0) for v in self.own.get(strategy) or (0.0, 0.0))
