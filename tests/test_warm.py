"""What a container's warm process (launcher.warm) imports before it forks ranks: what the
job's code imports anyway, and nothing a job without it would pay for. (Its forks, a rank
restarted from it, and one started afresh once it is gone: tests/test_recovery.py.)"""
import os
import subprocess
import sys

import pytest

import conf
from launcher import warm

pytestmark = pytest.mark.unit

GROUPS = [{"name": "a", "instances": 1, "vcores": 1, "memory": "1 GiB"}]


def _job(run, **extra):
    return conf.load_job({"name": "w", "groups": GROUPS, "run": run, **extra})


def test_the_built_in_runner_and_yarnapps_own_functions_are_imported_themselves(digits):
    job = conf.load_job({"name": "w", "groups": GROUPS,
                         "training": {"model": "digits_cnn", "data": {"train": f"{digits}/train"}}})
    assert warm.imports(job, ".") == ["training.runner"]
    assert warm.imports(_job({"function": "training.hello:main"}), ".") == ["training.hello"]


def test_a_scripts_top_level_libraries_are_imported_and_its_own_modules_are_not(tmp_path):
    (tmp_path / "train.py").write_text(
        "import os\nimport torch, torch.distributed as dist\nfrom torch import nn\nimport mymodels\n"
        "from . import helpers\nfrom training import dist as yd\n\ndef main():\n    import pandas\n")
    assert warm.imports(_job({"script": "train.py"}), str(tmp_path)) == [
        "torch", "torch.distributed", "torch.nn", "training", "training.dist"]
    (tmp_path / "plain.py").write_text("import json\nprint(json.dumps(1))\n")
    assert warm.imports(_job({"script": "plain.py"}), str(tmp_path)) == []       # pays nothing for torch


def test_a_function_modules_libraries_are_found_without_running_it(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("import numpy as np\nraise SystemExit('ran at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert warm.imports(_job({"function": "mine:main"}), str(tmp_path)) == ["numpy"]
    assert warm.imports(_job({"function": "not_a_module_anywhere:main"}), str(tmp_path)) == []
    (tmp_path / "broken.py").write_text("import torch\ndef (:\n")
    assert warm.imports(_job({"function": "broken:main"}), str(tmp_path)) == []     # the rank names it


def test_the_warm_process_never_initialises_mpi_or_cuda():
    """A fork of a process that initialised MPI or CUDA could use neither."""
    code = ("import sys, torch\nfrom launcher import warm\nimport importlib\n"
            "[importlib.import_module(m) for m in ['training.runner', 'training.dist', 'torch.distributed']]\n"
            "print('mpi4py.MPI' in sys.modules, torch.cuda.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_a_function_in_a_package_is_read_without_running_the_packages_init(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('ran at import')\n")
    (tmp_path / "pkg" / "train.py").write_text("import torch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert warm.imports(_job({"function": "pkg.train:main"}), str(tmp_path)) == ["torch"]


def test_a_script_that_sets_its_environment_before_importing_a_library_imports_it_itself(tmp_path):
    """`os.environ["OMP_NUM_THREADS"] = "1"` or `sys.path.insert(...)` then `import torch`: the
    library loads as the script has it load, after that line."""
    (tmp_path / "env.py").write_text('"""doc"""\nimport os\nimport numpy\nos.environ["OMP_NUM_THREADS"] = "1"\n'
                                     'import torch\n')
    assert warm.imports(_job({"script": "env.py"}), str(tmp_path)) == ["numpy"]
    (tmp_path / "path.py").write_text("import sys\nsys.path.insert(0, 'vendor')\nimport numpy\n")
    assert warm.imports(_job({"script": "path.py"}), str(tmp_path)) == []


def test_a_warm_process_that_fails_before_forking_starts_the_rank_afresh(tmp_path):
    """Its own error (here: no job in its environment) is not the rank's: the rank is started
    as a process of its own, its exit status is the rank's, and later ranks start so too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("YARNAPP_")}
    w = warm.Warm(env)
    rank = w.spawn(0, str(tmp_path / "hb"), [sys.executable, "-c", "import os; print(os.getpid()); exit(7)"], env)
    assert rank.wait() == 7 and w.failed and not w.alive()
    assert rank.pid != w.proc.pid and rank.poll() == 7


def test_a_pickled_functions_libraries_are_read_from_its_pickle(tmp_path):
    """A notebook's function (run.pickle, cloudpickle by value): the libraries it uses, named
    in its pickle, are imported before its ranks fork (they imported torch each, in their
    container, before); yarnapp's own modules are not (training.dist's world is MPI's)."""
    import cloudpickle
    code = ("import torch, numpy\nfrom training import dist\n"
            "def uses_torch(ctx):\n    return torch.zeros(1)\n"
            "def uses_dist(ctx):\n    return dist.rank()\n"
            "def plain(ctx):\n    return 1\n")
    scope = {}
    exec(compile(code, "notebook_cell", "exec"), scope)
    for name, want in (("uses_torch", ["torch"]), ("uses_dist", []), ("plain", [])):
        (tmp_path / f"{name}.pkl").write_bytes(cloudpickle.dumps(scope[name]))
        assert warm.imports(_job({"pickle": f"{name}.pkl"}), str(tmp_path)) == want, name
    (tmp_path / "broken.pkl").write_bytes(b"not a pickle")
    assert warm.imports(_job({"pickle": "broken.pkl"}), str(tmp_path)) == []      # the rank names it
