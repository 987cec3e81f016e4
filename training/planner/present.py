"""The plan presented: a table (`yarnapp plan`), a PNG of the simulated clusters, JSON.

It speaks of the methods by name (training.strategies' titles: "ring all-reduce",
"central parameter server, best/worst case", ...), not of the seeds they come from.
"""
import json

from training import strategies as registry
from training.perf.model import PlanError


def _modelled():
    return [name for name in registry.names() if registry.entry(name).cost]


def _rate(bps):
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _split_text(strategy, split):
    if split is None:
        return "-"
    if isinstance(split, dict):          # {layer: kernels per rank}
        return "kernels " + " ".join(f"{k}:{'/'.join(map(str, v))}" for k, v in split.items())
    return "rows " + "/".join(map(str, split))


def _scheduling_text(sc):
    if not sc:
        return "cpus: each rank has its own cores"
    cores = f"the ranks share {sc['cores']} cores" if sc["cores"] else "each rank has its own cores"
    own = sc.get("strategy_cpu") or {}
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}"    # noqa: E731  (None: not measured)
    worker = ("; the strategies' own CPU per step, rank 0 / others: "
              + ", ".join(f"{k} {ms(v[0])}/{ms(v[1])} ms" for k, v in own.items())) if own else ""
    return (f"cpus: {cores}; CFS period {sc['period_s'] * 1e3:g} ms; a polite wait costs "
            f"{sc['wait_s'] * 1e3:.2f} ms of CPU + {100 * sc['wait_cpu']:.0f}% of one while it lasts + "
            f"{sc.get('byte_s', 0) * 1e12:.0f} us per MB it receives{worker}")


def format_table(plan):
    """The plan as text: the job's predictions, the recommendation, the simulated clusters."""
    m, lk = plan["model"], plan["link"]
    lines = [f"plan for job {plan['job']!r}: {m['name']}, batch {m['batch']}, {m['params']:,} parameters "
             f"({m['param_bytes'] / 2**20:.2f} MiB), input {'x'.join(map(str, m['input_shape']))} "
             f"({m['input_from']})",
             f"link: {_rate(lk['bandwidth_bps'])}, latency {lk['latency_s'] * 1e6:.1f} us ({lk['source']})"
             + (f"; shared-memory all-reduce {lk['shared_memory_Bps'] / 1e9:.1f} GB/s (ranks on one host)"
                if lk.get("shared_memory_Bps") else ""),
             "ranks: " + "; ".join(f"{d['rank']} {d['name']} step {d['step_s'] * 1e3:.1f} ms" for d in plan["devices"]),
             _scheduling_text(plan.get("scheduling")),
             f"distributed convs {m['conv_layers']}: share of a step f = {m['conv_fraction']:.2f}; "
             f"rank 0 alone: {plan['single_s'] * 1e3:.1f} ms/step",
             "",
             f"{'strategy':21s} {'compute ms':>10s} {'comm ms':>9s} {'step ms':>9s} {'speedup':>8s}  split / notes"]
    for name in registry.names():
        title = registry.entry(name).title
        if name not in plan["strategies"]:
            lines.append(f"{name:21s} {'n/a':>10s} {'':9s} {'':9s} {'':8s}  {title}: no step-time model"
                         + ("; its volume is in the partition table" if (plan.get("volumes") or {}).get("rows")
                            else ""))
            continue
        p = plan["strategies"][name]
        if p is None:
            why = (plan.get("cannot_run") or {}).get(name)
            lines.append(f"{name:21s} {'n/a':>10s} {'':9s} {'':9s} {'':8s}  {title}: " + (
                f"cannot run this model: {why}" if why else
                "cannot run here (a layer has fewer kernels than there are ranks, or no conv layer to distribute)"))
            continue
        note = f"{title}; {_split_text(name, p['split'])}"
        if p.get("settled_from"):
            note += f" (recalibration settles there, from {_split_text(name, p['settled_from'])})"
        if p.get("bounds"):
            note += f"; best/worst case before quotas {p['bounds'][0] * 1e3:.1f}..{p['bounds'][1] * 1e3:.1f} ms"
        if p.get("bound"):
            note += f"; bound S <= {p['bound']:.2f}"
        lines.append(f"{name:21s} {p['compute_s'] * 1e3:10.2f} {p['comm_s'] * 1e3:9.3f} {p['step_s'] * 1e3:9.2f} "
                     f"{p['speedup']:8.2f}  {note}")
    for name, p in plan["speed_shares"].items():
        lines.append(f"{name + ' (speed)':21s} {p['compute_s'] * 1e3:10.2f} {p['comm_s'] * 1e3:9.3f} "
                     f"{p['step_s'] * 1e3:9.2f} {p['speedup']:8.2f}  {_split_text(name, p['split'])}")
    vol = plan.get("volumes") or {}
    if vol.get("rows"):
        lines += ["", f"{'partition':14s} {'KB/sample':>10s} {'max rank KB':>11s} {'imbalance':>9s} "
                      f"{'traffic saved vs data parallel':>30s}"]      # negative: more than data parallel
        for row in vol["rows"]:
            lines.append(f"{row['method']:14s} {row['volume_bytes_per_sample'] / 1e3:10.1f} "
                         f"{row['max_rank_bytes_per_sample'] / 1e3:11.1f} {row['imbalance']:9.3f} "
                         f"{100 * row['reduction_vs_data_parallel']:+29.1f}%")
    elif vol.get("note"):
        lines += ["", vol["note"]]
    lines += _gpu_beside_cpus(plan)
    r = plan["recommended"]
    best = (f"{r['strategy']} ({registry.entry(r['strategy']).title}; {r['why']}): {r['step_s'] * 1e3:.2f} ms/step, "
            f"speedup {r['speedup']:.2f}")
    one = r.get("one_container", len(plan["devices"]) > 1 and r["speedup"] < 1)    # (a plan of before the key)
    if one:
        # one recommendation, not the fastest strategy and then "run it on one"
        lines += ["", "recommended: one container like rank 0's: every strategy is predicted slower than it, so "
                      "spreading this model costs more than it saves", f"(the fastest spread: {best})"]
    else:
        lines += ["", f"recommended: {best}"]
    lines += _against_the_jobs_own(plan, one) + [""]
    if plan["scaling"]:
        names = [s for s in _modelled() if s in plan["scaling"][0]["strategies"]]
        lines.append(f"{'cluster':8s} {'bandwidth':>11s} {'machines':>8s} " +
                     " ".join(f"{s[:12]:>12s}" for s in names) + f" {'bound':>6s}")
        beyond = False
        for row in plan["scaling"]:
            cells = []
            for s in names:
                p = row["strategies"][s]
                # more than m times faster on m like machines: a noisy measurement
                over = bool(p) and row["cluster"] == "cpu" and p["speedup"] > row["machines"] * (1 + TIE)
                beyond = beyond or over
                cells.append(f"{p['speedup']:11.2f}{'!' if over else ' '}" if p else f"{'n/a':>12s}")
            bound = f"{row['bound']:6.2f}" if row["bound"] else f"{'-':>6s}"
            lines.append(f"{row['cluster']:8s} {_rate(row['bandwidth_bps']):>11s} {row['machines']:8d} "
                         + " ".join(cells) + " " + bound)
        lines.append("(speedup over one machine like rank 0's container; gpu+cpu: over the GPU alone; bound: "
                     "conv_model_parallel's, splitting the convs only: data parallelism splits the whole step)")
        if beyond:
            lines.append("! more than m times faster on m machines: the layers' timings were noisy (a busy "
                         "machine, or --quick); plan again on a quiet machine")
    return "\n".join(lines)


# Predictions closer than this are a tie. The planner's median |error| on configurations it
# had never run is 12% (2026-11-30, benchmarks/README.md), but mostly alike for every strategy
# of one job (seed_cnn 64/192: +2.5..+6.7%); apart where a strategy's own cost is misjudged
# (conv-MP on a ResNet: +28% beside the ring's +10%).
TIE = 0.05


def _against_the_jobs_own(plan, one_container=False):
    """A line when the job's own strategy is not the recommended one: how far behind it is
    predicted, and whether that is within the planner's error (then keep the job's). Where
    one container is recommended, against that: "keep the job's" beside the fastest spread
    strategy read as overruling the recommendation."""
    mine, r = plan.get("job_strategy"), plan["recommended"]
    p = plan["strategies"].get(mine) if mine else None
    if p and one_container:
        return [f"the job's {mine} on its {len(plan['devices'])} containers: {p['step_s'] * 1e3:.2f} ms/step, "
                f"speedup {p['speedup']:.2f}: slower than one container"]
    if not p or mine == r["strategy"]:
        return []
    slower = p["step_s"] / r["step_s"] - 1
    text = (f"the job's {mine}: {p['step_s'] * 1e3:.2f} ms/step, speedup {p['speedup']:.2f}, "
            f"{100 * slower:.1f}% slower")
    if slower <= TIE:
        text += " (within the planner's error: either will do; keep the job's)"
    return [text]


def _gpu_beside_cpus(plan):
    """When the job mixes a GPU rank 0 with CPU ranks: do the CPU ranks help? The GPU
    alone (rank 0's step) against the best data-parallel prediction with shares by speed."""
    names = [d["name"] for d in plan["devices"]]
    gpu = [n for n in names if "(cuda)" in n or "(gpu " in n]
    if not gpu or len(gpu) == len(names) or names[0] not in gpu:
        return []
    if any("gpu not measured" in n for n in gpu):      # (one CPU thread's speed was called the GPU's)
        return ["", "gpu + cpus: not judged, for the GPU was not measured (no CUDA here): plan on a machine with "
                    "CUDA, or give --gpu-speed N (the GPU as N x rank 0's CPU threads)"]
    batch, alone = plan["model"]["batch"], plan["single_s"]
    best = min(((n, p) for n, p in plan["speed_shares"].items() if p), key=lambda x: x[1]["step_s"], default=None)
    if best is None:
        return []
    name, p = best
    verdict = "they help" if p["step_s"] < alone else "they do not help: train on the GPU alone"
    return ["", f"gpu + cpus: the GPU alone {batch / alone:.1f} samples/s; with the {len(names) - len(gpu)} CPU "
                f"rank(s) ({name}, shares by speed, rows {'/'.join(map(str, p['split']))}) "
                f"{batch / p['step_s']:.1f} samples/s: {verdict}"]


def write_png(plan, path):
    """Predicted speedup against the number of machines, per strategy and bandwidth (and the
    conv bound), one panel per simulated cluster kind; matplotlib's Agg canvas (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    kinds = list(dict.fromkeys(r["cluster"] for r in plan["scaling"]))
    if not kinds:
        raise PlanError("nothing to plot: no simulated clusters")
    fig = Figure(figsize=(6.5 * len(kinds), 4.8))
    FigureCanvasAgg(fig)
    colors = dict(zip(_modelled(), ("tab:blue", "tab:red", "tab:orange", "tab:green", "tab:purple")))
    styles = ["-", "--", ":", "-."]
    for i, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), i + 1)
        rows = [r for r in plan["scaling"] if r["cluster"] == kind]
        rates = list(dict.fromkeys(r["bandwidth_bps"] for r in rows))
        for j, bps in enumerate(rates):
            sel = sorted((r for r in rows if r["bandwidth_bps"] == bps), key=lambda r: r["machines"])
            for s in colors:
                pts = [(r["machines"], r["strategies"][s]["speedup"]) for r in sel if r["strategies"][s]]
                if pts:
                    ax.plot(*zip(*pts), styles[j % len(styles)], color=colors[s], marker="o", markersize=3,
                            label=f"{s} @ {_rate(bps)}")
        bound = sorted({(r["machines"], r["bound"]) for r in rows if r["bound"]})
        if bound:
            ax.plot(*zip(*bound), color="gray", linewidth=1, label="conv bound 1/((1-f)+f/k)")
        ms = sorted({r["machines"] for r in rows})
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_xlabel("machines")
        ax.set_ylabel("predicted speedup")
        ax.set_title(f"{plan['model']['name']}, batch {plan['model']['batch']}: {kind}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PlanError(f"--png {path}: cannot write it ({e.strerror or e}); give a writable path") from None
    return path


def write_json(plan, path):
    try:
        with open(path, "w") as f:
            json.dump(plan, f, indent=1)
    except OSError as e:
        raise PlanError(f"--json {path}: cannot write it ({e.strerror or e}); give a writable path") from None
    return path
