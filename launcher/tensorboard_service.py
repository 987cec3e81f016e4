"""TensorBoard as a service of the application (job.yaml `tensorboard.service: true`).

On YARN it is the skein service `tensorboard` (yarnapp.backends.yarn.build_spec); on
the local engine the application master starts it once the containers run
(`start_local`) and stops it at shutdown (`stop_local`). Either way it:

    serves the application's logdir (tensorboard.logdir, else <app dir>/tensorboard;
        a non-local URI is synced to a local cache every tensorboard.sync_every)
    publishes `http://<host>:<port>` in the store under keys.TENSORBOARD (owned: it
        vanishes with the service); on YARN it also adds itself as the page `tensorboard`
        of skein's web UI, and `yarnapp status` shows that page's URL through the
        ResourceManager's web proxy, which every viewer of the application can reach
    runs until SIGTERM (exit 0) or until TensorBoard dies (exit 1: skein may restart
        it; losing TensorBoard never fails the training)

On YARN TensorBoard binds every interface of its node and the URL names the node;
on the local engine it binds 127.0.0.1.

    python -m launcher.tensorboard_service
"""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading

from . import keys, store as store_mod

log = logging.getLogger("launcher.tensorboard_service")

LOCAL_ID = "tensorboard"      # its id in the local engine's store (owner of the URL key)
YARN_PAGE = "tensorboard"     # its page of skein's web UI on YARN (yarnapp.backends.yarn_reports.TENSORBOARD_PAGE)
RESTARTS = 3                  # TensorBoard started again after it dies (killed, out of memory), at most


def logdir(job, app_dir):
    return job.tensorboard.logdir or os.path.join(app_dir, "tensorboard")


def main():
    import conf
    from yarnapp.errors import YarnappError
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s tensorboard-service %(name)s: %(message)s")
    with open(os.environ["YARNAPP_JOB"]) as f:
        job = conf.load_job(json.load(f), stored=True)
    backend = os.environ.get("YARNAPP_BACKEND", "local")
    from .identity import app_dir_from_env
    app_id = os.environ.get("YARNAPP_APP_ID") or os.environ.get("SKEIN_APPLICATION_ID", "unknown")
    where = logdir(job, app_dir_from_env(os.environ, app_id))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    store = store_mod.from_env()
    tb = None
    try:
        for restart in range(RESTARTS + 1):
            tb = _serve(where, backend, job.tensorboard.sync_every, store)
            _publish(tb, where, backend, store, again=restart > 0)
            while not stop.wait(0.5) and tb.alive:
                pass
            if stop.is_set():
                return 0
            code = tb.proc.returncode
            if restart == RESTARTS:
                log.error("TensorBoard exited with status %s, the %d restarts spent", code, RESTARTS)
                return 1
            # (killed, or out of memory: the page a user had open went dark, and status said nothing)
            log.warning("TensorBoard exited with status %s; starting it again (%d of %d)", code, restart + 1,
                        RESTARTS)
            tb.stop()
    except YarnappError as e:
        log.error("%s", e)
        return 1
    finally:
        if tb is not None:
            tb.stop()               # first: its files go even where the store is gone
        try:
            store.delete(keys.TENSORBOARD)
        except Exception as e:  # noqa: BLE001 - the application's end took the store (YARN's master) with it
            log.info("TensorBoard's address not removed from the store: %s", e)


def _publish(tb, where, backend, store, again=False):
    """Say where TensorBoard answers: the store's key, which status shows; on YARN also a page
    of skein's web UI, reachable through the ResourceManager's proxy
    (http://RM/proxy/<app>/pages/tensorboard/, under the application's view ACL) and not only
    at this node's address."""
    if backend == "yarn":
        if again:
            store.app.ui.remove_page(YARN_PAGE)
        page = store.app.ui.add_page(YARN_PAGE, tb.url.rstrip("/"), link_name="TensorBoard")
        log.info("TensorBoard page of the application's web UI: %s", page.address)
    store.put(keys.TENSORBOARD, tb.url.rstrip("/"), owned=True)
    log.info("TensorBoard on %s at %s", where, tb.url)


def _serve(where, backend, sync_every, store):
    """TensorBoard on `where`. Locally, on the port an earlier start of the service bound
    where it is free (a restarted application master starts the service again: the page a
    user has open goes on answering), else on any; on YARN the web UI's page stays."""
    from yarnapp.errors import YarnappError
    from yarnapp.hadoop import port_free
    from yarnapp.tensorboard import TensorBoard
    host = "127.0.0.1" if backend == "local" else "0.0.0.0"
    # Its scratch (its log, a remote logdir's copy) in its own directory (on YARN its container's,
    # which YARN removes), not /tmp: a service killed with its master left it there for good.
    sweep(os.getcwd())      # what an earlier start left (its master killed: it died at once, PDEATHSIG)
    before = store.get(keys.TENSORBOARD_PORT) if backend == "local" else None
    if before and port_free(int(before)):          # (locally on 127.0.0.1, as port_free looks)
        try:
            tb = TensorBoard(where, port=int(before), host=host, sync_every=sync_every, scratch=os.getcwd())
        except YarnappError as e:
            log.info("TensorBoard on port %d of its earlier start failed (%s): on another", int(before), e)
        else:
            return tb
    tb = TensorBoard(where, host=host, sync_every=sync_every, scratch=os.getcwd())
    if backend == "local":
        store.put(keys.TENSORBOARD_PORT, str(tb.port))
    return tb


def sweep(directory):
    """Remove the scratch directories TensorBoards of the service left in `directory` (its
    working directory), killed before they could."""
    from yarnapp.tensorboard import TensorBoard
    for n in os.listdir(directory) if directory and os.path.isdir(directory) else ():
        if n.startswith(TensorBoard.SCRATCH_PREFIX):
            shutil.rmtree(os.path.join(directory, n), ignore_errors=True)


def start_local(app_dir, app_id, store_root):
    """Start the service as a process of a local application (its application master calls this).

    It carries YARNAPP_APP_ID, so the master's final sweep ends it whatever happens; its
    log is `yarnapp logs APP --container tensorboard`.
    """
    from .procs import die_with_parent
    log_dir = os.path.join(app_dir, "containers", LOCAL_ID)
    os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ, YARNAPP_BACKEND="local", YARNAPP_APP_ID=app_id, YARNAPP_CONTAINER_ID=LOCAL_ID,
               YARNAPP_JOB=os.path.join(app_dir, "job.json"), YARNAPP_STORE=store_root,
               YARNAPP_APP_DIR=app_dir, PYTHONUNBUFFERED="1")
    with open(os.path.join(log_dir, "container.log"), "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launcher.tensorboard_service"], cwd=log_dir, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)
    proc.workdir = log_dir          # (stop_local sweeps it)
    return proc


def stop_local(proc, store, timeout=5.0):
    """Stop a service start_local started: SIGTERM, then SIGKILL; its URL key goes with it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # TensorBoard itself dies with it (PDEATHSIG)
            except ProcessLookupError:
                pass
            proc.wait()
    sweep(getattr(proc, "workdir", None))     # a service killed: its TensorBoard's scratch stayed
    store.release(LOCAL_ID)


if __name__ == "__main__":
    sys.exit(main())
