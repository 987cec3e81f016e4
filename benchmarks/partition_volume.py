"""Communication volume and balance of hypergraph-partitioned model parallelism (Eserol
2019) against the conv-layer split, a layer-wise (pipeline) split and data parallelism.

    python benchmarks/partition_volume.py            # LeNet, VGG-11, grouped VGG-11; K = 2, 3, 4
    python benchmarks/partition_volume.py --quick    # LeNet only, no measured execution

Networks (CIFAR-10 input 3x32x32, float32): LeNet-5 (62k weights) and VGG-11 without
batch norm (9.2M weights), from training.partition; and VGG-11 with groups=4 in every
conv after the first, where the structure lets a partition avoid crossing traffic.
For each network and K ranks of equal capacity (and of unequal capacities 2:1, 2:1:1,
2:2:1:1), training.partition.partition_report gives per sample, forward + backward:

    hypergraph     Mt-KaHyPar, km1 objective, ε = 0.03 relative to each rank's capacity
    conv_split     every conv split over all ranks in proportion (linear layers on rank 0)
    pipeline       contiguous whole layers per rank, cut points minimising max load/target
    data_parallel  ring all-reduce, 2(K−1)/K·|W| per rank per step, 2(K−1)·|W| in all,
                   divided by the global batch B (default 128)

and, for the two model-parallel baselines, the hypergraph partition constrained to
their own imbalance ("HP@same balance"; the baseline is also given to the partitioner
as a start, and the volume it finds without that start is shown as [fresh]). Also: the
hypergraph volume for ε in 0.01..0.3 (the balance–volume trade-off), and — unless
--quick — bytes actually sent by training.strategies.hypergraph in one real step on
ranks joined as containers join (training.probes.run_argv) against the volume the
partition predicts.

Prints a table and writes benchmarks/results/partition_volume.json.
"""
import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import common  # noqa: E402  (the JSON's path)

EQUAL = {2: [1.0, 1.0], 3: [1.0, 1.0, 1.0], 4: [1.0, 1.0, 1.0, 1.0]}
UNEQUAL = {2: [2.0, 1.0], 3: [2.0, 1.0, 1.0], 4: [2.0, 2.0, 1.0, 1.0]}
EPSILONS = (0.01, 0.03, 0.1, 0.3)


def networks(quick):
    from training.partition import LeNetCIFAR, VGGCIFAR
    nets = {"lenet": lambda: LeNetCIFAR()}
    if not quick:
        nets["vgg11"] = lambda: VGGCIFAR()
        nets["vgg11_g4"] = lambda: VGGCIFAR(groups=4)
    return nets


# -- inside the MPI world: one real step, bytes sent ------------------------------------------

def worker(case):
    import torch
    import torch.nn.functional as F
    from launcher.world import join_local
    from training import partition as P
    from training.probes import finish, report
    from training.strategies.hypergraph.execution import PartitionedModel
    comm, rank, _ = join_local()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = networks(False)[case["network"]]()
    chain = P.layer_chain(model, model.input_shape)
    hg = P.build_hypergraph(chain)
    parts = None
    if comm.Get_rank() == 0:
        parts, _ = P.hypergraph_partition(hg, EQUAL[comm.Get_size()], P.EPSILON)
    parts = comm.bcast(parts, root=0)
    net = PartitionedModel(chain, parts, comm, model)
    del model
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(case["batch"], 3, 32, 32, generator=g), torch.randint(0, 10, (case["batch"],), generator=g)
    comm.Barrier()
    t0 = time.perf_counter()
    out = net(x)
    if comm.Get_rank() == net.loss_rank:
        F.cross_entropy(out, y).backward()
    else:
        torch.autograd.backward([out], [torch.zeros_like(out)])
    seconds = time.perf_counter() - t0
    sent = comm.allreduce(net.counters.sent_bytes)
    comm_s = comm.gather(net.counters.comm_s, root=0)
    predicted = 2 * case["batch"] * P.evaluate(hg, parts, EQUAL[comm.Get_size()])["forward_bytes_per_sample"]
    report(rank, {"sent_bytes": int(sent), "predicted_bytes": float(predicted), "step_s": seconds,
                  "comm_s": comm_s})
    finish(comm)


def execute(network, k, batch, timeout=600):
    """One real step on k ranks joined as containers join (training.probes.run)."""
    from training import probes
    argv = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps({"network": network, "batch": batch})]
    result = probes.run_argv(argv, k, timeout=timeout)
    return {"network": network, "k": k, "batch": batch, **result}


# -- the table ---------------------------------------------------------------------------------

def _kb(v):
    return f"{v / 1024:10.1f}"


def print_case(name, case):
    rows = case["rows"]
    caps = ":".join(f"{c:g}" for c in case["capacities"])
    for r in rows:
        extra = ""
        m = r.get("hypergraph_at_same_balance")
        if m:
            extra = (f"  HP@same balance {_kb(m['volume_bytes_per_sample']).strip()} KB "
                     f"(imb {m['imbalance']:.3f}) [fresh {_kb(m['fresh_volume_bytes_per_sample']).strip()}]")
        b = r.get("break_even_batch")
        reduction = 100 * r["reduction_vs_data_parallel"]
        print(f"{name:9s} {case['k']:2d} {caps:8s} {r['method']:14s}{_kb(r['volume_bytes_per_sample'])}"
              f"{_kb(r['max_rank_bytes_per_sample'])} {r['imbalance']:9.3f} {reduction:8.1f}%"
              f" {'' if b is None else f'{b:8.0f}':>8s}{extra}")


def claims(case):
    """The issue's check: at equal or better balance, the hypergraph volume is <= the best
    other model-parallel split's (matched rows), and whether the ε = 0.03 partition alone is."""
    rows = {r["method"]: r for r in case["rows"]}
    best = min(("conv_split", "pipeline"), key=lambda m: rows[m]["volume_bytes_per_sample"])
    m = rows[best]["hypergraph_at_same_balance"]
    hp = rows["hypergraph"]
    return {"best_other": best,
            "matched_holds": bool(m["volume_bytes_per_sample"] <= rows[best]["volume_bytes_per_sample"]
                                  and m["imbalance"] <= rows[best]["imbalance"] + 1e-4),
            "matched_fresh_holds": bool(m["fresh_volume_bytes_per_sample"]
                                        <= rows[best]["volume_bytes_per_sample"]),
            "headline_dominates": bool(hp["volume_bytes_per_sample"] <= rows[best]["volume_bytes_per_sample"]
                                       and hp["imbalance"] <= rows[best]["imbalance"] + 1e-4),
            "headline_better_balance": bool(hp["imbalance"] <= rows[best]["imbalance"] + 1e-4),
            "reduction_vs_data_parallel": hp["reduction_vs_data_parallel"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="LeNet only, no measured execution")
    p.add_argument("--batch", type=int, default=128, help="global batch for data parallelism's per-sample volume")
    p.add_argument("--exec-batch", type=int, default=4, help="rows of the measured step")
    common.add_out(p, "partition_volume")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    from importlib.metadata import version

    import torch
    from training import partition as P
    torch.manual_seed(0)
    result = {"batch": a.batch, "epsilon": P.EPSILON, "element_bytes": 4,
              "partitioner": {"package": "mtkahypar", "version": version("mtkahypar"),
                              "preset": "default", "threads": 1, "objective": "km1"},
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "units": "bytes per sample, forward + backward, summed over ranks; imbalance = max_r W_r/T_r - 1",
              "networks": {}}
    print(f"batch {a.batch}, float32; volume per sample (forward + backward, all ranks), KB = 1024 bytes")
    print(f"{'network':9s} {'K':>2s} {'caps':8s} {'method':14s}{'KB/sample':>10s}{'max-rank':>10s} "
          f"{'imbalance':>9s} {'vs DP':>9s} {'B*':>8s}")
    for name, make in networks(a.quick).items():
        model = make()
        chain = P.layer_chain(model, model.input_shape)
        hg = P.build_hypergraph(chain)
        net = {"parameters": sum(p.numel() for p in model.parameters()), "parameter_bytes": chain.parameter_bytes,
               "units": hg.num_vertices, "nets": len(hg.nets), "pins": int(len(hg.pins)),
               "gflops_per_sample_fwd_bwd": hg.total_weight / 1e9, "cases": [], "tradeoff": []}
        for caps_of in (EQUAL, UNEQUAL):
            for k in (2, 3, 4):
                t0 = time.perf_counter()
                rows = P.partition_report(model, model.input_shape, caps_of[k], a.batch, chain=chain)
                case = {"k": k, "capacities": caps_of[k], "rows": rows, "seconds": time.perf_counter() - t0}
                case["claims"] = claims(case)
                net["cases"].append(case)
                print_case(name, case)
        for k in (2, 3, 4):
            for eps in EPSILONS:
                parts, info = P.hypergraph_partition(hg, EQUAL[k], eps)
                e = P.evaluate(hg, parts, EQUAL[k])
                net["tradeoff"].append({"k": k, "epsilon": eps, "imbalance": e["imbalance"],
                                        "volume_bytes_per_sample": e["volume_bytes_per_sample"],
                                        "seconds": info["seconds"]})
        print(f"{name}: hypergraph volume (KB/sample) by ε, equal capacities: " + "; ".join(
            f"K={k}: " + ", ".join(f"{t['epsilon']:g}->{t['volume_bytes_per_sample'] / 1024:.1f}"
                                   for t in net["tradeoff"] if t["k"] == k) for k in (2, 3, 4)))
        result["networks"][name] = net
    if not a.quick:
        result["executed"] = []
        for name in ("lenet", "vgg11"):
            for k in (2, 3, 4):
                r = execute(name, k, a.exec_batch)
                result["executed"].append(r)
                print(f"executed {name} K={k} batch {r['batch']}: sent {r['sent_bytes']} bytes, predicted "
                      f"{r['predicted_bytes']:.0f} "
                      f"({'equal' if r['sent_bytes'] == r['predicted_bytes'] else 'DIFFERENT'})")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
