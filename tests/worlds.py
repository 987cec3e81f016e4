"""Run a module of tests/ranks on n ranks joined as containers join; rank 0's result."""
import os

from training import probes

HERE = os.path.dirname(os.path.abspath(__file__))


def run(module, n, args=None, timeout=240):
    """The RESULT of `python -m ranks.<module> ARGS_JSON` on n joined ranks (training.probes.run);
    a failure raises with every rank's output."""
    try:
        return probes.run(f"ranks.{module}", n, args, timeout=timeout, env=probes.environment([HERE]))
    except probes.ProbeError as e:
        raise AssertionError(f"{e}\n{getattr(e, 'output', '')}") from None
