"""The rank process: started by the agent in every container, once per generation.

It joins the MPI world, builds the RunContext and calls the job's function (or runs
its script). Exit status 0 means this rank finished the job.
"""
import argparse
import importlib
import json
import logging
import os
import runpy
import sys
import time

from . import identity, keys, network, store as store_mod, world

log = logging.getLogger("launcher.rank")


def _call(job, ctx):
    from training import context as context_mod
    context_mod._set_current(ctx)
    if job.run.function:
        module, func = job.run.function.split(":")
        fn = getattr(importlib.import_module(module), func)
        return fn(ctx)
    sys.argv = [job.run.script] + list(job.run.args)
    runpy.run_path(job.run.script, run_name="__main__")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--heartbeat", required=True)
    args = p.parse_args(argv)
    ident = identity.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{ident.rank} {ident.container} %(name)s: %(message)s")
    store = store_mod.from_env()
    gen = args.generation
    with open(args.heartbeat, "w") as f:
        f.write(f"setup {time.time()}")

    net = network.configure()   # MPI over this container's own address (emulated nodes); else no-op
    comm, took = world.join(store, gen, ident.rank, ident.world_size, ident.secret,
                            timeout=ident.job.launcher.rendezvous_timeout,
                            aborted=lambda: store.get(keys.abort(gen)) is not None)
    assert comm.Get_rank() == ident.rank and comm.Get_size() == ident.world_size
    import socket
    info = comm.gather({"rank": ident.rank, "container": ident.container, "host": socket.gethostname(),
                        "pid": os.getpid(), **(net or {})}, root=0)
    if ident.rank == 0:
        store.put(keys.formed(gen), json.dumps({"time": time.time(), "seconds": took, "members": info}))
    log.info("world generation %d formed: rank %d of %d in %.2fs", gen, ident.rank, ident.world_size, took)

    from training.context import RunContext, rank_infos
    ranks = rank_infos(ident.job)
    ctx = RunContext(comm=comm, rank=ident.rank, world_size=ident.world_size, ranks=ranks,
                     job=ident.job, app_id=ident.app_id, generation=gen, workdir=os.getcwd(),
                     checkpoint_uri=ident.checkpoint_uri, logdir=ident.logdir,
                     publish=store.put, heartbeat_path=args.heartbeat)
    ctx.heartbeat("setup")
    _call(ident.job, ctx)
    comm.Barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip MPI_Finalize's disconnect handshake between singleton-joined processes:
    # the world already agreed (Barrier) that every rank is done.
    os._exit(0)


if __name__ == "__main__":
    main()
