"""The built-in runner's optimizers do not import torch._dynamo (1.4 CPU-seconds at every
rank's start) until something compiles, and their updates are torch's own, bit for bit."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = r"""
import copy, json, sys
import torch
from training import lazy_dynamo
if sys.argv[1] == "defer":
    lazy_dynamo.defer()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 6 * 6, 3))
twin = copy.deepcopy(model)
x, y = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])

def train(m):
    for opt in (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(m.parameters(), lr=0.01)):
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        opt.load_state_dict(opt.state_dict())
    return torch.is_grad_enabled()

grad_after = train(model)
imported = "torch._dynamo" in sys.modules
import torch._dynamo                     # torch's own path from here on
train(twin)
equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
compiled = torch.compile(lambda t: (t * 2).sum(), backend="eager")(torch.ones(3)).item()
print(json.dumps({"imported": imported, "equal": equal, "grad_after": grad_after, "compiled": compiled}))
"""


def _run(mode):
    out = subprocess.run([sys.executable, "-c", TRAIN, mode], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_optimizers_train_without_importing_dynamo_and_update_as_torch_does():
    plain, deferred = _run("plain"), _run("defer")
    assert plain["imported"] is True                 # torch's optimizers import it: what defer() saves
    assert deferred["imported"] is False
    assert deferred["equal"] and deferred["grad_after"] is True
    assert deferred["compiled"] == 6.0               # torch.compile still works once dynamo is loaded
