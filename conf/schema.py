"""The job.yaml schema: typed models that reject unknown keys and wrong types.

Every default lives in ``conf/defaults.yaml``; the models here declare no defaults of
their own, so the defaults file is the single place a default can be read or changed
(``conf.load_job`` merges it under the user's file before validation).
"""
import ipaddress
import re
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      model_validator)

from .units import parse_duration_s, parse_memory_mib, parse_rate_bps

MemoryMiB = Annotated[int, BeforeValidator(parse_memory_mib)]
Seconds = Annotated[float, BeforeValidator(parse_duration_s)]
BitsPerSecond = Annotated[float, BeforeValidator(parse_rate_bps)]
Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")]


def _module_function(value):
    if value is not None and (value.count(":") != 1 or not all(value.split(":"))):
        raise ValueError(f"expected 'package.module:function', got {value!r}")
    return value


def _ipv4_subnet(value):
    try:
        net = ipaddress.IPv4Network(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 subnet such as 10.77.0.0/24") from None
    if net.num_addresses < 4:
        raise ValueError(f"{value!r} is too small for emulated nodes; use at most a /30")
    return str(net)


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Group(Model):
    """A worker group: `instances` containers with the same resources."""
    name: Name
    instances: Annotated[int, Field(ge=1)]
    memory: MemoryMiB
    vcores: Annotated[float, Field(gt=0)]
    gpus: Annotated[int, Field(ge=0)]
    node_label: Optional[str]
    env: Dict[str, str]


class Run(Model):
    """What each rank runs: a `module:function` called with the RunContext, a script, or
    a function shipped pickled (what `yarnapp.submit(job, function=f)` writes); and the
    user's files shipped into every container (yarnapp.shipping)."""
    function: Annotated[Optional[str], AfterValidator(_module_function)]
    script: Optional[str]
    pickle: Optional[str]
    args: List[str]
    files: Optional[List[str]]
    editable: bool

    @model_validator(mode="after")
    def _one_of(self):
        given = [k for k in ("function", "script", "pickle") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"give one of run.function, run.script or run.pickle, not {' and '.join(given)}")
        if not given:
            raise ValueError("give run.function (module:function) or run.script (a .py file)")
        return self


class Data(Model):
    """Parquet datasets (directories of shards) at any pyarrow filesystem URI."""
    train: str
    test: Optional[str]
    prefetch: Annotated[int, Field(ge=0)]


class AllReduce(Model):
    bucket_mb: Annotated[float, Field(gt=0)]
    ring_threshold_kb: Annotated[float, Field(ge=0)]


class ModelParallel(Model):
    layers: Optional[List[str]]
    split: Optional[List[Annotated[float, Field(gt=0)]]]
    recalibrate_every: Annotated[int, Field(ge=0)]


class Training(Model):
    """The built-in runner's configuration (run.function = training.runner:main)."""
    strategy: Literal["allreduce", "conv_model_parallel", "ps_central", "ps_sharded", "hypergraph"]
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
    seed: int
    shares: Union[Literal["speed", "equal", "vcores"], List[Annotated[float, Field(gt=0)]]]
    log_every: Annotated[int, Field(ge=1)]
    allreduce: AllReduce
    model_parallel: ModelParallel


def _resume(value):
    if value in ("never", "latest") or re.fullmatch(r"app_\d{8}_\d{6}_[0-9a-f]+|application_\d+_\d+", value):
        return value
    raise ValueError(f"expected never, latest or an application id such as app_20261123_101500_ab12cd "
                     f"or application_1700000000000_0001, got {value!r}")


class Checkpoint(Model):
    uri: Optional[str]
    resume: Annotated[str, AfterValidator(_resume)]
    every_steps: Optional[Annotated[int, Field(ge=1)]]
    every_seconds: Optional[Seconds]
    keep: Annotated[int, Field(ge=1)]


class TensorBoard(Model):
    logdir: Optional[str]
    service: bool
    sync_every: Seconds


class Environment(Model):
    """The Python environment shipped to YARN containers (local engine: this one)."""
    packer: Literal["venv-pack", "conda-pack", "none"]
    archive: Optional[str]


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
    storage: Optional[str]


class Launcher(Model):
    rendezvous_timeout: Seconds
    heartbeat_timeout: Seconds
    poll_interval: Seconds


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
    def _cross_checks(self):
        seen = set()
        for g in self.groups:
            if g.name in seen:
                raise ValueError(f"groups: duplicate group name {g.name!r}")
            seen.add(g.name)
        if self.run.function == "training.runner:main" and self.training is None:
            raise ValueError("training: required when run.function is the built-in training.runner:main")
        if self.training and isinstance(self.training.shares, list) and len(self.training.shares) != self.world_size:
            raise ValueError(f"training.shares: {len(self.training.shares)} shares given for "
                             f"{self.world_size} ranks")
        return self

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
                            "memory_mib": g.memory, "gpus": g.gpus})
        return out


def container_id(group, instance):
    """Container names are `<group>_<instance>`, as skein names service instances."""
    return f"{group}_{instance}"
