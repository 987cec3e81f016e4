import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lanes  # noqa: E402  (tests/, on the path just above)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    lanes.default_workers(config)


def pytest_collection_modifyitems(config, items):
    lanes.order(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with lanes.lane(item.config, alone=item.get_closest_marker("alone") is not None,
                    next_alone=nextitem is not None and nextitem.get_closest_marker("alone") is not None):
        yield


def pytest_configure(config):
    # Started in the background by a non-interactive shell (`pytest ... &`), Python finds
    # SIGINT ignored and so would every process the tests start: the tests that press
    # Ctrl-C need it as a user's terminal delivers it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.option.durations is None:     # the suite's budget (20 min on CI's 2 cores): where it goes
        config.option.durations = 40
    config.addinivalue_line("markers", "yarn: runs on a real YARN: the suite's own single-node Hadoop "
                            "(tests/test_yarn_real.py), or your cluster with YARNAPP_TEST_YARN=1")
    config.addinivalue_line("markers", "slow: a multi-process job taking more than a few seconds")
    config.addinivalue_line("markers", "alone: runs while no other test runs (its verdict rests on the machine's "
                            "time or CPU being its own; tests/lanes.py)")
    # Tiers, by what a test module starts (python -m pytest -m unit | multiprocess | e2e):
    config.addinivalue_line("markers", "unit: no ranks and no jobs: functions, the agent's states on scripted "
                            "monitor results, specs, files (seconds in all)")
    config.addinivalue_line("markers", "multiprocess: MPI ranks joined as containers join (tests/ranks/, "
                            "training.probes), without a whole job")
    config.addinivalue_line("markers", "e2e: whole applications through yarnapp.submit or the CLI, on the "
                            "local engine (or a real YARN with the yarn marker)")


@pytest.fixture
def yarnapp_home(tmp_path, monkeypatch):
    """Every test gets its own local-engine home (applications, logs, stores). A test that
    fails (or times out) with its application still running kills it, so that it does not
    take the CPUs of the tests after it."""
    home = tmp_path / "yarnapp-home"
    monkeypatch.setenv("YARNAPP_HOME", str(home))
    # not the machine's ledger; beside tmp_path, whose listing some tests assert
    monkeypatch.setenv("YARNAPP_LEDGER", str(tmp_path.parent / f"{tmp_path.name}-ledger" / "leases.json"))
    yield home
    if (home / "apps").is_dir():
        from yarnapp.backends.base import TERMINAL
        from yarnapp.backends.local.engine import LocalBackend
        backend = LocalBackend()
        for app in backend.list():
            if app["state"] not in TERMINAL:
                backend.kill(app["app_id"])


@pytest.fixture
def cli(yarnapp_home):
    """Run the real `yarnapp` console script; returns CompletedProcess."""
    def run(*args, timeout=300, check=None):
        proc = subprocess.run([sys.executable, "-m", "yarnapp.cli", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        if check is not None:
            assert proc.returncode == check, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc
    return run


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits imported once as Parquet (train/ and test/ under the path)."""
    from training.data import import_digits
    d = tmp_path_factory.mktemp("data") / "digits"
    import_digits(str(d))
    return str(d)
