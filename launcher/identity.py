"""Who this container is, read once from the environment both engines set.

The contract (set by the local engine, or by the skein spec on YARN):
    YARNAPP_BACKEND     local | yarn
    YARNAPP_APP_ID      the application id (on YARN: SKEIN_APPLICATION_ID)
    YARNAPP_CONTAINER_ID  <group>_<instance> (on YARN: SKEIN_CONTAINER_ID)
    YARNAPP_GROUP       the worker group
    YARNAPP_JOB         path of the resolved job spec (JSON)
    YARNAPP_SECRET      local engine: per-application secret that admits a process into the world
                        (a process's environment is readable by its user only)
    YARNAPP_SECRET_FILE YARN: a localized file holding it instead (YARN shows a container's
                        environment to everyone who may view the application: its
                        launch_container.sh is among the aggregated logs)
    YARNAPP_STORE       local engine only: directory of the coordination store
    YARNAPP_APP_DIR     local engine only: the application's directory
    YARNAPP_STORAGE     YARN: where applications keep what outlives them (a URI on the cluster's
                        default filesystem); the application's directory is <storage>/<app id>
"""
import dataclasses
import functools
import hashlib
import json
import os
import re

import conf


@dataclasses.dataclass(frozen=True)
class Identity:
    backend: str
    app_id: str
    container: str
    group: str
    instance: int
    rank: int
    job: conf.JobSpec
    secret: str
    app_dir: str

    @property
    def world_size(self):
        return self.job.world_size

    def adopt(self, store):
        """For a replacement container: take the slot of its group whose container is gone.

        Returns a new Identity whose `container` is the slot's name (e.g. cpu_1 for a
        skein replacement named cpu_2); the slot's alive key is claimed atomically.
        """
        from . import keys
        for r in self.job.ranks():
            if r["group"] == self.group and self.store_claim(store, keys.alive(r["container"])):
                return dataclasses.replace(self, container=r["container"], instance=r["instance"], rank=r["rank"])
        raise RuntimeError(f"container {self.container}: every slot of group {self.group} is taken")

    @staticmethod
    def store_claim(store, key):
        return store.put_if_absent(key, json.dumps({"incarnation": "claimed"}), owned=True)

    def rank_info(self, rank=None):
        return self.job.ranks()[self.rank if rank is None else rank]

    @property
    def checkpoint_uri(self):
        return self.job.checkpoint.uri or os.path.join(self.app_dir, "checkpoints")

    @property
    def checkpoint_siblings(self):
        """With checkpoint.uri unset, every application checkpoints in its own directory
        (<dir>/<app id>/checkpoints): <dir>, where `resume` finds the others (the local
        engine's applications, or yarn.storage). None when the URI is set (they are under it)."""
        if self.job.checkpoint.uri:
            return None
        parent, _, name = self.app_dir.rstrip("/").rpartition("/")
        return parent if name == self.app_id and parent else None

    @property
    def logdir(self):
        return self.job.tensorboard.logdir or os.path.join(self.app_dir, "tensorboard")


def checkpoint_dir(app, base=None, siblings=None):
    """Where application `app` checkpoints: `base`/<app> under a checkpoint.uri's path; with
    the URI unset, in its own directory, `siblings`/<app>/checkpoints/<app> (its URI is
    Identity.checkpoint_uri, <app dir>/checkpoints, and training.checkpoint adds <app>)."""
    if siblings:
        return f"{siblings.rstrip('/')}/{app}/checkpoints/{app}"
    return f"{base.rstrip('/')}/{app}"


def complete_steps(names):
    """The steps of the complete checkpoints among the entry names of a checkpoint_dir,
    oldest first (step-00000050; one being written is step-00000050.tmp-<gen>)."""
    return sorted(int(m.group(1)) for n in names if (m := re.match(r"step-(\d{8,})$", n)))




@functools.lru_cache(maxsize=1)
def code():
    """"<digest> <root>": a digest of the .py files of yarnapp's packages this process
    imports, and where they are. The YARN client passes its own to the containers
    ($YARNAPP_CODE), whose ranks say when theirs differs: a cluster's python3 with another
    yarnapp installed (packer: none) ran other code than the client's, and said nothing."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for pkg in conf.PACKAGES:
        for d, dirs, files in sorted(os.walk(os.path.join(root, pkg))):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(x for x in files if x.endswith(".py")):
                path = os.path.join(d, f)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    digest.update(fh.read())
    return f"{digest.hexdigest()[:16]} {root}"


def secret_from_env(env):
    if env.get("YARNAPP_SECRET_FILE"):
        with open(env["YARNAPP_SECRET_FILE"]) as f:
            return f.read().strip()
    return env.get("YARNAPP_SECRET", "")


def app_dir_from_env(env, app_id):
    """The application's directory: the local engine's, <YARNAPP_STORAGE>/<app id> on YARN,
    else the working directory."""
    if env.get("YARNAPP_APP_DIR"):
        return env["YARNAPP_APP_DIR"]
    if env.get("YARNAPP_STORAGE"):
        return f"{env['YARNAPP_STORAGE'].rstrip('/')}/{app_id}"
    return os.getcwd()


def job_from_env(environ=None):
    """The application's job (YARNAPP_JOB)."""
    with open((os.environ if environ is None else environ)["YARNAPP_JOB"]) as f:
        return conf.load_job(json.load(f), stored=True)


def from_env(environ=None):
    env = os.environ if environ is None else environ
    container = env.get("YARNAPP_CONTAINER_ID") or env["SKEIN_CONTAINER_ID"]
    job = job_from_env(env)
    group, _, instance = container.rpartition("_")
    # -1: a replacement container with a new instance number (skein numbers a
    # restarted instance after the service's count); the agent adopts a free slot.
    rank = next((r["rank"] for r in job.ranks() if r["container"] == container), -1)
    app_id = env.get("YARNAPP_APP_ID") or env.get("SKEIN_APPLICATION_ID", "unknown")
    return Identity(backend=env.get("YARNAPP_BACKEND", "local"), app_id=app_id,
                    container=container, group=group, instance=int(instance), rank=rank, job=job,
                    secret=secret_from_env(env), app_dir=app_dir_from_env(env, app_id))
