"""The job.yaml schema: typed models that reject unknown keys and wrong types.

Every default lives in ``conf/defaults.yaml``; the models here declare no defaults of
their own, so the defaults file is the single place a default can be read or changed
(``conf.load_job`` merges it under the user's file before validation).
"""
import datetime
import ipaddress
import re
import typing
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo,
                      model_validator)

from .augment import Augment
from .units import parse_duration_s, parse_memory_mib, parse_rate_bps

MemoryMiB = Annotated[int, BeforeValidator(parse_memory_mib)]


def _args(value):
    """run.args: YAML's numbers (`[--epochs, 1]`) as the strings a command line has."""
    if isinstance(value, list):
        return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    return value


def submitting(info: ValidationInfo):
    """Whether a job is being submitted, not read back from an application's job.json
    (conf.load_job(stored=True)): checks added since an application was submitted must
    not stop its logs, status, clean or restarts."""
    return not (info.context or {}).get("stored")


ENV_VALUE_MAX = 128 * 1024     # Linux's limit on one "KEY=value" of an environment (MAX_ARG_STRLEN)
SET_BY_YARNAPP = {"CUDA_VISIBLE_DEVICES": "each container sees exactly its own GPUs (groups[].gpus)"}


def _env(value, info: ValidationInfo):
    """A group's env: YAML's numbers (`OMP_NUM_THREADS: 1`) as the strings an environment
    has (a job file's numbers there are read as their text: conf.numbers_as_text); a
    boolean is refused, naming every one (true is "True", "true" or "1" to programs)."""
    if not isinstance(value, dict):
        return value
    flags = [k for k, v in value.items() if isinstance(v, bool)]
    if flags:
        raise ValueError(f"{', '.join(map(str, flags))}: a boolean; give the text the program reads, quoted "
                         f"(\"1\", \"true\")")
    for k, v in value.items():
        if v is None:
            raise ValueError(f"{k}: no value; give '' (quoted) for an empty one")
        if isinstance(v, (datetime.date, datetime.time)):
            raise ValueError(f"{k}: read as a date ({v}); quote it to give it as text: {k}: '{v}'")
    for k, v in value.items() if submitting(info) else ():  # (the master's Popen failed on them: "FAILED: unknown")
        if isinstance(k, str) and (not k or "=" in k or "\0" in k):
            raise ValueError(f"{k!r} is not an environment variable's name (empty, or with '=' or a NUL byte)")
        if isinstance(v, str) and "\0" in v:
            raise ValueError(f"{k}: its value holds a NUL byte, which an environment cannot")
        if isinstance(v, str) and len(f"{k}={v}".encode()) >= ENV_VALUE_MAX:
            raise ValueError(f"{k}: its value is {len(v.encode()):,} bytes; Linux takes at most 128 KiB a variable: "
                             f"ship it as a file (run.files) and give its name")
        if k in SET_BY_YARNAPP:
            raise ValueError(f"{k}: yarnapp sets it: {SET_BY_YARNAPP[k]}; remove it")
        if k == "OMP_NUM_THREADS" and not re.fullmatch(r"[1-9][0-9]*", str(v).strip()):
            raise ValueError(f"{k}: {v!r}; give a number of threads, e.g. 2 (by default each rank runs as "
                             f"many as its vcores, rounded up)")
    return {k: str(v) if isinstance(v, (int, float)) else v for k, v in value.items()}


def _not_empty(value, info: ValidationInfo):
    """A path or URI given as '': it meant the submit directory (os.path.join(base, ''))."""
    if value is not None and not value.strip() and submitting(info):
        raise ValueError("empty: give a path or URI, or leave the field out")
    return value


Path = Annotated[Optional[str], AfterValidator(_not_empty)]


Seconds = Annotated[float, BeforeValidator(parse_duration_s)]
BitsPerSecond = Annotated[float, BeforeValidator(parse_rate_bps)]
Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")]


def _module_function(value):
    if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
        raise ValueError(f"expected 'package.module:function', got {value!r}")
    if value is not None:
        module, func = value.split(":")
        if module.endswith(".py") or "/" in module:     # a file named where Python wants its module
            name = module.rsplit("/", 1)[-1].removesuffix(".py")
            raise ValueError(f"{value!r} names a file; name its module as Python imports it: {name}:{func} "
                             f"(and ship {module} with run.files)")
    return value


def _ipv4_subnet(value, info: ValidationInfo):
    try:
        net = ipaddress.IPv4Network(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 subnet such as 10.77.0.0/24") from None
    if not submitting(info):       # (a refusal added since the application was submitted)
        return str(net)
    if net.num_addresses < 4:
        raise ValueError(f"{value!r} is too small for emulated nodes; use at most a /30")
    kind = ("loopback" if net.is_loopback else "multicast" if net.is_multicast else "link-local" if net.is_link_local
            else "reserved" if net.is_reserved or net.network_address.packed[0] == 0 else None)
    if kind:        # 127.0.0.0/24: node0 got 127.0.0.1, MPI took `lo`, and the world never formed
        raise ValueError(f"{value!r} is a {kind} range, which emulated nodes cannot use; give a private one "
                         f"such as 10.77.0.0/24")
    return str(net)


TENSORBOARD_SERVICE = "tensorboard"      # the TensorBoard service's name among the groups (YARN: a skein service)
PACKAGES = ("conf", "launcher", "training", "yarnapp")   # yarnapp's own top-level packages, in every rank
BUILTIN_RUNNER = "training.runner:main"    # run.function of the built-in runner, which needs `training`
MIN_VCORES = 0.01    # a CPU quota of 1 ms per 100 ms period: the least the kernel's CFS accepts


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class Group(Model):
    """A worker group: `instances` containers with the same resources."""
    name: Name
    instances: Annotated[int, Field(ge=1)]
    memory: MemoryMiB
    vcores: Annotated[float, Field(ge=MIN_VCORES)]
    gpus: Annotated[int, Field(ge=0)]
    node_label: Optional[str]
    env: Annotated[Dict[str, str], BeforeValidator(_env)]


def _local_file(value, info: ValidationInfo):
    """run.files are copied from this machine: a URI was joined to the submit directory (and
    its // collapsed), then said not to exist."""
    value = _not_empty(value, info)
    if value and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", value) and submitting(info):
        raise ValueError(f"{value} is a URI; run.files ships files and directories of this machine only, by their "
                         f"paths: read a remote one from its URI in your code (pyarrow.fs, fsspec), or copy it here "
                         f"first")
    return value


class Run(Model):
    """What each rank runs: a `module:function` called with the RunContext, a script, or
    a function shipped pickled (what `yarnapp.submit(job, function=f)` writes); and the
    user's files shipped into every container (yarnapp.shipping)."""
    function: Annotated[Optional[str], AfterValidator(_module_function)]
    script: Path
    pickle: Path
    args: Annotated[List[str], BeforeValidator(_args)]
    files: Optional[List[Annotated[str, AfterValidator(_local_file)]]]
    editable: bool

    @model_validator(mode="after")
    def _one_of(self):
        given = [k for k in ("function", "script", "pickle") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"give one of run.function, run.script or run.pickle, not {' and '.join(given)}")
        if not given:
            raise ValueError("give run.function (module:function) or run.script (a .py file)")
        return self


def _shape(v):
    if v is not None and (len(v) != 3 or not all(x > 0 for x in v)):
        raise ValueError(f"expected [C, H, W], three positive integers, got {v!r}")
    return v




class DataColumns(Model):
    image: str
    label: str
    class_name: Optional[str]


class Data(Model):
    """The training and test sets: Parquet datasets at any pyarrow filesystem URI, or a
    user's map-style dataset (docs/data.md)."""
    train: Path
    test: Path
    dataset: Annotated[Optional[str], AfterValidator(_module_function)]
    dataset_options: Dict[str, Any]
    columns: DataColumns
    shape: Annotated[Optional[List[int]], AfterValidator(_shape)]
    mean: Optional[List[float]]
    std: Optional[List[Annotated[float, Field(gt=0)]]]
    augment: Augment
    test_transforms: Augment
    transform: Annotated[Optional[str], AfterValidator(_module_function)]
    workers: Optional[Annotated[int, Field(ge=1)]]
    memory: Optional[MemoryMiB]
    shuffle_window: MemoryMiB
    prefetch: Annotated[int, Field(ge=0)]

    @model_validator(mode="after")
    def _source(self):
        if bool(self.train) == bool(self.dataset):
            raise ValueError("give train (a Parquet dataset URI) or dataset (a package.module:factory)"
                             if not self.train else "give train or dataset, not both")
        if self.dataset and self.test:
            raise ValueError("test is for Parquet data; a dataset factory is called with split='test'")
        if (self.mean is None) != (self.std is None) or (self.mean and len(self.mean) != len(self.std)):
            raise ValueError("give mean and std together, one value per channel")
        return self


# -- the strategies: one model each, tagged by `name` ------------------------------------------
# `training.strategy` is one of these (a bare name in a job.yaml takes that strategy's
# defaults: conf/defaults.yaml `strategies:`). Each strategy's implementation, registered
# under the same name, is training.strategies.<package>; tests/test_strategy_names.py
# checks that every name is here, in the registry, the defaults, the docs and the planner.

class AllReduce(Model):
    """Ring all-reduce data parallelism (training.strategies.allreduce)."""
    name: Literal["allreduce"]
    bucket_mb: Annotated[float, Field(gt=0)]
    ring_threshold_kb: Annotated[float, Field(ge=0)]
    shared_memory: bool


class CentralPS(Model):
    """A central parameter server on rank 0 (training.strategies.ps)."""
    name: Literal["ps_central"]


class ShardedPS(Model):
    """A parameter server sharded over every rank (training.strategies.ps)."""
    name: Literal["ps_sharded"]


class ConvModelParallel(Model):
    """Conv-layer model parallelism (training.strategies.conv_mp)."""
    name: Literal["conv_model_parallel"]
    layers: Optional[List[str]]
    split: Optional[List[Annotated[float, Field(gt=0)]]]
    recalibrate_every: Annotated[int, Field(ge=0)]
    fuse: bool


class Hypergraph(Model):
    """Hypergraph-partitioned model parallelism (training.strategies.hypergraph)."""
    name: Literal["hypergraph"]
    capacities: Optional[List[Annotated[float, Field(gt=0)]]]
    epsilon: Annotated[float, Field(gt=0, lt=1)]


STRATEGY_CONFIGS = (AllReduce, ConvModelParallel, CentralPS, ShardedPS, Hypergraph)
StrategyConfig = Annotated[Union[STRATEGY_CONFIGS], Field(discriminator="name")]


def strategy_names():
    """Every strategy's name, in STRATEGY_CONFIGS order."""
    return [typing.get_args(c.model_fields["name"].annotation)[0] for c in STRATEGY_CONFIGS]


def strategy_fields(name):
    """The fields of strategy `name`'s own block (besides `name`)."""
    cfg = next(c for c in STRATEGY_CONFIGS if typing.get_args(c.model_fields["name"].annotation)[0] == name)
    return [f for f in cfg.model_fields if f != "name"]


def _shares(value):
    """A precise line for a bad weight (the union's own error named neither the entry nor the rule)."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"weight [{i}] must be a finite number > 0, got {v!r}; give one weight per rank")
    elif value not in ("speed", "equal", "vcores"):
        raise ValueError(f"expected equal, vcores, speed or a list of weights > 0 (one per rank), got {value!r}")
    return value


BUILTIN_MODELS = ("digits_cnn", "seed_cnn", "resnet", "mlp")   # training.models.MODELS' names (the
                                                                # client checks training.model against them)
BUILTIN_MIN_HW = {"digits_cnn": 2, "seed_cnn": 4}               # the least image height and width each takes
                                                                # (its pooling), else 1: checked without torch
DATA_MEMORY_FRACTION = 0.25    # training.data.memory: null = this much of the container's memory (here: the
                               # client reads it without pyarrow)


def _seed(value, info: ValidationInfo):
    if submitting(info) and not -2 ** 63 <= value < 2 ** 64:      # (the ranks' torch.manual_seed: a traceback)
        raise ValueError(f"{value} is out of torch's range for a seed, -2**63 to 2**64-1")
    return value


class Training(Model):
    """The built-in runner's configuration (run.function = training.runner:main)."""
    strategy: StrategyConfig
    model: str
    model_options: Dict[str, Any]
    data: Data
    batch_size: Annotated[int, Field(ge=1)]
    epochs: Annotated[int, Field(ge=1)]
    max_steps: Optional[Annotated[int, Field(ge=1)]]
    optimizer: Literal["sgd", "adam"]
    lr: Annotated[float, Field(gt=0)]
    momentum: Annotated[float, Field(ge=0, lt=1)]
    weight_decay: Annotated[float, Field(ge=0)]
    seed: Annotated[int, AfterValidator(_seed)]
    shares: Annotated[Union[Literal["speed", "equal", "vcores"], List[Annotated[float, Field(gt=0)]]],
                      BeforeValidator(_shares)]
    precision: Literal["fp32", "bf16", "fp16"]
    log_every: Annotated[int, Field(ge=1)]


def _resume(value):
    if value in ("never", "latest") or re.fullmatch(r"app_\d{8}_\d{6}_[0-9a-f]+|application_\d+_\d+", value):
        return value
    raise ValueError(f"expected never, latest or an application id such as app_20261123_101500_ab12cd "
                     f"or application_1700000000000_0001, got {value!r}")


class Checkpoint(Model):
    uri: Path
    resume: Annotated[str, AfterValidator(_resume)]
    every_steps: Optional[Annotated[int, Field(ge=1)]]
    every_seconds: Optional[Seconds]
    keep: Annotated[int, Field(ge=1)]


class TensorBoard(Model):
    logdir: Path
    service: bool
    sync_every: Seconds


class Environment(Model):
    """The Python environment shipped to YARN containers (local engine: this one)."""
    packer: Literal["venv-pack", "conda-pack", "none"]
    archive: Path


class YarnAcls(Model):
    """Who besides the submitting user may view / modify (kill) the application on YARN."""
    enable: bool
    view_users: List[str]
    view_groups: List[str]
    modify_users: List[str]
    modify_groups: List[str]


class Yarn(Model):
    """YARN-only settings (the local engine ignores them)."""
    acls: YarnAcls
    storage: Path


MAX_POLL_S = 10.0     # launcher.poll_interval's most: agents look this often (every end and restart waits a look)


class Launcher(Model):
    rendezvous_timeout: Seconds
    heartbeat_timeout: Seconds
    idle_timeout: Seconds
    poll_interval: Seconds

    @model_validator(mode="after")
    def _polls_within_the_limits(self, info: ValidationInfo):
        """A limit no longer than a look between two can never be kept (heartbeat_timeout:
        1ms failed every rank hung; poll_interval: 1h trained, then never ended)."""
        if not submitting(info):
            return self
        if self.poll_interval > MAX_POLL_S:
            raise ValueError(f"poll_interval: {self.poll_interval:g}s; agents look this often, and every end and "
                             f"restart waits for a look: give at most {MAX_POLL_S:g}s (the default: 200ms)")
        for name in ("heartbeat_timeout", "rendezvous_timeout", "idle_timeout"):
            if getattr(self, name) <= self.poll_interval:
                raise ValueError(f"{name}: {getattr(self, name):g}s is not longer than poll_interval "
                                 f"({self.poll_interval:g}s), how often the agents look; give several of them")
        return self


class Network(Model):
    """Emulated nodes on the local engine: a network namespace per node (needs root)."""
    nodes: Annotated[int, Field(ge=0)]
    placement: Literal["spread", "by-group"]
    bandwidth: Optional[BitsPerSecond]
    latency: Optional[Seconds]
    subnet: Annotated[str, AfterValidator(_ipv4_subnet)]


class JobSpec(Model):
    name: Name
    queue: str
    backend: Literal["local", "yarn"]
    groups: Annotated[List[Group], Field(min_length=1)]
    run: Run
    training: Optional[Training]
    max_restarts: Annotated[int, Field(ge=0)]
    am_attempts: Annotated[int, Field(ge=1)]
    checkpoint: Checkpoint
    tensorboard: TensorBoard
    environment: Environment
    yarn: Yarn
    launcher: Launcher
    network: Network

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo):
        if submitting(info):
            self._submit_checks()
        seen = set()
        for i, g in enumerate(self.groups):
            if g.name in seen:
                raise ValueError(f"groups: duplicate group name {g.name!r}")
            seen.add(g.name)
            if self.tensorboard.service and g.name == TENSORBOARD_SERVICE:     # on YARN, its skein service
                raise ValueError(f"groups[{i}].name: {TENSORBOARD_SERVICE!r} names the TensorBoard service when "
                                 f"tensorboard.service is true; rename the group")
        if self.run.function == BUILTIN_RUNNER and self.training is None:
            raise ValueError("training: required when run.function is the built-in training.runner:main (the "
                             "default); give a training: section, or run.script or run.function for your own code")
        if self.run.function != BUILTIN_RUNNER and self.checkpoint.resume != "never":
            raise ValueError(f"checkpoint.resume: {self.checkpoint.resume!r} is for the built-in runner, which "
                             f"writes the checkpoints it resumes from; your own code resumes from its own snapshots "
                             f"(TORCHELASTIC_RESTART_COUNT says when it restarts): drop it (or --resume)")
        if self.training and isinstance(self.training.shares, list) and len(self.training.shares) != self.world_size:
            raise ValueError(f"training.shares: {len(self.training.shares)} shares given for "
                             f"{self.world_size} ranks")
        precision = self.training.precision if self.training else "fp32"
        name = self.training.strategy.name if self.training else None
        if precision != "fp32" and name in ("conv_model_parallel", "hypergraph"):
            raise ValueError(f"training.precision: {precision} is for the data-parallel strategies (allreduce, "
                             f"ps_central, ps_sharded); {name} trains in fp32: remove the field")
        if precision == "fp16" and name in ("ps_central", "ps_sharded"):
            raise ValueError(f"training.precision: fp16 needs the loss scaling of allreduce; {name} takes bf16 "
                             "or fp32")
        for field in ("split", "capacities"):       # one weight per rank (conv-MP, hypergraph)
            weights = getattr(self.training.strategy, field, None) if self.training else None
            if weights is not None and len(weights) != self.world_size:
                raise ValueError(f"training.strategy.{field}: {len(weights)} weights given for "
                                 f"{self.world_size} ranks; give one per rank")
        return self

    def _submit_checks(self):
        """What a submit refuses, and an application's job.json read back does not (see submitting)."""
        if self.run.args and not self.run.script:       # (ignored without a word)
            raise ValueError(f"run.args: only run.script reads them (as sys.argv[1:]); "
                             f"{'the built-in runner' if self.run.function == BUILTIN_RUNNER else 'a function'} "
                             f"is called with its context, and its settings are the job's: drop run.args")
        held = self.training.data.memory if self.training else None
        least = min(self.groups, key=lambda g: g.memory, default=None)
        if held and least is not None and held >= least.memory:     # (a bare number of bytes, read as MiB)
            raise ValueError(f"training.data.memory: {held} MiB, not less than the {least.memory} MiB of group "
                             f"{least.name!r}'s containers, whose ranks hold that much of the data besides the model "
                             f"(a bare number is MiB); give less, e.g. {max(1, least.memory // 4)} MiB, or drop "
                             f"it for a quarter of each container's memory")

    @property
    def world_size(self):
        return sum(g.instances for g in self.groups)

    def ranks(self):
        """Deterministic rank order: groups in file order, then instance."""
        out = []
        for g in self.groups:
            for i in range(g.instances):
                out.append({"rank": len(out), "group": g.name, "instance": i,
                            "container": container_id(g.name, i), "vcores": g.vcores,
                            "memory_mib": g.memory, "gpus": g.gpus,
                            "omp_threads": omp_threads(g)})
        return out


def omp_threads(group):
    """The threads a group's env sets its ranks (OMP_NUM_THREADS), or None: its vcores decide.
    (A stored job from before the check may hold OpenMP's "4,2": None.)"""
    value = str(group.env.get("OMP_NUM_THREADS", "")).strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def container_id(group, instance):
    """Container names are `<group>_<instance>`, as skein names service instances."""
    return f"{group}_{instance}"
