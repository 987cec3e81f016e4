"""The torch.distributed contract, as torchrun sets it, in every rank.

After the world of generation `gen` is formed, every rank knows where every other runs,
so it can export what `torch.distributed.init_process_group(init_method="env://")`
and torchrun-style scripts read, before the user's code starts:

    RANK, WORLD_SIZE                  the rank in the world and its size (group order)
    LOCAL_RANK, LOCAL_WORLD_SIZE      among this application's containers on the same
                                      host (its emulated node on the local engine); a
                                      container with GPUs is a host of its own (0 and 1),
                                      as a Kubernetes pod is: it sees only its own GPUs, so
                                      `torch.cuda.set_device(LOCAL_RANK)` picks its first
    GROUP_RANK                        the index of that host, hosts ordered by their
                                      lowest rank (torchrun: the node rank; a container
                                      with GPUs counts as a host)
    GROUP_WORLD_SIZE                  the number of hosts (torchrun: the nodes)
    ROLE_RANK, ROLE_WORLD_SIZE        = RANK, WORLD_SIZE (one role: workers)
    MASTER_ADDR, MASTER_PORT          where rank 0's TCPStore will listen: rank 0 binds a
                                      free port for this generation and publishes it
                                      through the store (keys.master(gen))
    TORCHELASTIC_RESTART_COUNT        the generation (0, then +1 after every restart)
    TORCHELASTIC_MAX_RESTARTS         the job's max_restarts
    TORCHELASTIC_RUN_ID               the application id

A port is chosen the way torchrun chooses one: bind port 0, read the number, close.
Between that and the user's TCPStore binding it another process could take it; a
restart then picks another.
"""
import json
import os
import socket

from . import keys


def host_key(environ=None):
    """What makes two containers 'on the same host': their emulated node, else the host name."""
    env = os.environ if environ is None else environ
    return env.get("YARNAPP_NODE") or socket.gethostname()


def master_address(backend, environ=None):
    """The address other ranks reach rank 0 at: its own (emulated node) address, the
    NodeManager's host name on YARN, else loopback (every container on this machine)."""
    env = os.environ if environ is None else environ
    if env.get("YARNAPP_HOST_ADDR"):
        return env["YARNAPP_HOST_ADDR"]
    if backend == "yarn":
        return env.get("NM_HOST") or socket.getfqdn()
    return "127.0.0.1"


def free_port(addr):
    """A TCP port that was free on `addr` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]


def local_layout(hosts, rank):
    """(local_rank, local_world_size, group_rank) of `rank` from every rank's host key."""
    mine = hosts[rank]
    order = list(dict.fromkeys(hosts))           # hosts by their lowest rank
    same = [r for r, h in enumerate(hosts) if h == mine]
    return same.index(rank), len(same), order.index(mine)


def contract(comm, store, gen, rank, size, backend, app_id, max_restarts, own_gpus=False):
    """Collective over the world `comm`: the torch.distributed variables of this rank
    (a dict of strings). Rank 0 picks MASTER_PORT and publishes it in the store.
    own_gpus: this rank's container holds GPUs (a host of its own: LOCAL_RANK 0)."""
    # (set_device(LOCAL_RANK) of the second GPU container on a host: "invalid device ordinal")
    hosts = comm.allgather(f"{host_key()}#rank{rank}" if own_gpus else host_key())
    master = None
    if rank == 0:
        addr = master_address(backend)
        master = {"addr": addr, "port": free_port(addr)}
        store.put(keys.master(gen), json.dumps(master))
    master = comm.bcast(master, root=0)
    local_rank, local_size, group_rank = local_layout(hosts, rank)
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(group_rank),
            "GROUP_WORLD_SIZE": str(len(set(hosts))),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size), "ROLE_NAME": "worker",
            "MASTER_ADDR": master["addr"], "MASTER_PORT": str(master["port"]),
            "TORCHELASTIC_RESTART_COUNT": str(gen), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": app_id}
