"""yarnapp: train CNNs across the mixed CPUs and GPUs of a YARN cluster.

    import yarnapp
    run = yarnapp.submit("conf/examples/digits.yaml")   # or a dict / conf.JobSpec
    run.wait(progress=True); run.final; run.logs(); run.kill()
"""


def _quiet_ctrl_c_while_importing():
    """The `yarnapp` command stopped by Ctrl-C while it imports (before cli.main, which says
    "interrupted" itself) ends as it would later: that word and status 130, no traceback.
    cli.main puts Python's own handler back."""
    import os
    import signal
    import sys
    if os.path.basename(sys.argv[0] if sys.argv else "") != "yarnapp" \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return                  # a notebook or a script importing yarnapp keeps its KeyboardInterrupt (and
                                # a command started with Ctrl-C ignored, in a script's background, ignores it)

    def interrupted(signum, frame):
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130)
    interrupted.yarnapp_importing = True
    signal.signal(signal.SIGINT, interrupted)


_quiet_ctrl_c_while_importing()


def _own_packages_first():
    """yarnapp's sibling packages (conf, training, launcher) are top-level names: a user's
    conf.py or training/ in the notebook's directory, first on sys.path, would shadow them
    and break `import yarnapp` with a bare ModuleNotFoundError. Say so in one line."""
    import importlib
    import importlib.util
    import os
    import sys
    home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("conf", "training", "launcher"):
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module else None
        if module is None:
            spec = importlib.util.find_spec(name)
            origin = spec.origin if spec else None
        if origin and os.path.dirname(os.path.dirname(os.path.abspath(origin))) != home:
            args = getattr(sys, "orig_argv", [])
            cli = "-m" in args and args.index("-m") + 1 < len(args) and args[args.index("-m") + 1].startswith("yarnapp")
            if cli and name not in sys.modules:
                # `python -m yarnapp.cli` in a project with a training/ of its own: the command
                # runs none of the project's code, so yarnapp's packages come first for it (a
                # job of that project's is then refused at submit, in one line)
                sys.path.insert(0, home)
                importlib.invalidate_caches()
                continue
            raise ImportError(f"{origin} shadows yarnapp's own package {name!r} (in {home}): rename it, or "
                              f"import yarnapp from another directory")


import launcher  # noqa: E402,F401  (first: it makes `conf` yarnapp's own beside a conf/ folder)

_own_packages_first()
from .api import Run, clean, kill, list_apps, load, status, submit  # noqa: F401
from .errors import Interrupted, JobFailed, WaitTimeout, YarnappError  # noqa: F401

__version__ = "0.1.0"
