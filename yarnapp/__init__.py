"""yarnapp: train CNNs across the mixed CPUs and GPUs of a YARN cluster.

    import yarnapp
    run = yarnapp.submit("conf/examples/digits.yaml")   # or a dict / conf.JobSpec
    run.wait(progress=True); run.final; run.logs(); run.kill()
"""
from .api import Run, kill, list_apps, load, status, submit  # noqa: F401
from .errors import JobFailed, YarnappError  # noqa: F401

__version__ = "0.1.0"
