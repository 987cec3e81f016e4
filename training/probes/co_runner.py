"""The job's model trained in a loop, one thread, on `rows` random rows: the work of another
rank on this machine, while the planner measures (training.planner.job.co_runners).
Prints READY once it has run a step, then runs until killed, or until the process that
started it (its pid: `parent` in the arguments) is gone (killed with no chance to stop its co-runners: SIGKILL, the OOM
killer, a plain `kill` of a script that does not catch SIGTERM)."""
import os

import torch
import torch.nn.functional as F

from training.models import build_model
from training.probes import arguments


def main():
    a = arguments()
    parent = a.get("parent") or os.getppid()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(a["model"], tuple(a["shape"]), a["classes"], a["options"])
    x = torch.randn(a["rows"], *a["shape"])
    y = torch.randint(0, a["classes"], (a["rows"],))
    F.cross_entropy(model(x), y).backward()
    print("READY", flush=True)
    while os.getppid() == parent:       # else reparented: the planner is gone (maybe before we started)
        F.cross_entropy(model(x), y).backward()


if __name__ == "__main__":
    main()
