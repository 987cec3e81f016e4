"""`yarnapp plan`: the predicted step time and speedup of every strategy for a job.

The planner measures and presents; what a strategy costs is its own cost model
(training.strategies.<name>.cost, on the vocabulary of training.perf). Where each
concern lives:

    profile.py   layer profiling: the model's compute on this machine (Profile)
    link.py      the link: a ping-pong of two joined ranks (training.probes.pingpong)
    cpu.py       what a polite wait costs, and every strategy's own CPU per step
                 (training.probes.wait_cpu, training.probes.strategy_cpu)
    job.py       a job's plan: measure_job (Measured) and plan_from (predictions for the
                 job's containers, the recommendation, simulated clusters)
    options.py   PlanOptions and `yarnapp plan`'s options
    present.py   the table, the PNG, the JSON

What is measured (on this machine, unless given): the job's model layer by layer at its
batch, its row counts and conv shares as the ranks will run them (after idle pauses
where a rank sleeps while it waits), beside co-runners standing for the job's other
ranks on the local engine; the link (α from 8-byte messages, β from cache-cold 4 MiB
ones; α again beside busy processes where the job has more ranks than this machine
has cores); what a polite wait costs (a + r·wait + b·bytes of CPU); and what each
strategy spends per step on its own (hooks, copies, the server's sums, the conv-MP
protocol, MPI calls), counted by the strategies themselves (training.cputime) while they
run for real on two joined ranks. Both CPU costs matter most where CPU is scarce: on a
0.5-vcore rank they come out of its quota.

Simulated clusters (more machines, other bandwidths, GPU/CPU mixes as in the seed
thesis) use the same cost models with devices of a given speed factor: a machine like
rank 0's container (speed 1) and, with `gpu_speed`, a GPU = a device whose times are
rank 0's divided by gpu_speed, as the master of n−1 such CPUs.

Not modelled: overlap of the ring's buckets with backward, a server's own CPU growing
with its workers (it is measured with one), other load on the machine; hypergraph
partitioning has no step-time model (its communication volume is reported instead).
"""
import importlib

# Imported on first use (PEP 562): profiling and the probes need torch, and `yarnapp plan`
# checks its flags (options.py) before anything heavy is imported.
_WHERE = {
    "training.perf.formulas": ["amdahl_bound", "central_ps_s", "proportional_s", "ring_allreduce_s", "sharded_ps_s"],
    "training.perf.model": ["DEFAULT_LATENCY_S", "Case", "Device", "Layer", "Link", "PlanError", "Profile",
                            "Scheduling", "link_from_rate", "share_weights"],
    ".cpu": ["measure_strategy_cpu", "measure_wait_cpu"],
    ".job": ["Measured", "co_runners", "job_devices", "measure_job", "modelled", "plan_from", "plan_job",
             "predict", "predict_all", "simulate"],
    ".link": ["local_load", "measure_link", "on_one_host"],
    ".options": ["QUICK_MIN_TIME", "PlanOptions", "check_plannable", "parse_options"],
    ".present": ["format_table", "write_json", "write_png"],
    ".profile": ["idle_profile", "measure_profile", "measure_rows", "measure_shares"],
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = list(_MODULE)


def __getattr__(name):
    module = _MODULE.get(name)
    if module is None:
        if f".{name}" in _WHERE:        # a submodule: planner.cpu, planner.job, ...
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
