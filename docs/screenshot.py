"""Save a PNG of TensorBoard's scalars dashboard for a run, rendered by headless Chromium.

    python docs/screenshot.py APP [-o tensorboard.png]          # an application (its logdir)
    python docs/screenshot.py LOGDIR --run RUN [-o FILE]         # a logdir (path or URI)
    python docs/screenshot.py http://127.0.0.1:6006/ --run RUN   # a TensorBoard already running

For an application or a logdir it starts TensorBoard (yarnapp.tensorboard), waits
until the run has `--tag` data, screenshots, and stops it. The page opens on the
scalars dashboard with the run selected (`regexInput`), tags matching `--tag`
first (`tagFilter`) and no smoothing. Needs `chromium` (Debian: apt-get install chromium).
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def dashboard_url(base, run=None, tag="loss"):
    """The scalars dashboard of `base` with `run` selected and tags matching `tag` first."""
    params = {"regexInput": f"^{run}$" if run else "", "tagFilter": tag or "", "_smoothingWeight": "0"}
    frag = "&".join(f"{k}={urllib.parse.quote(v, safe='')}" for k, v in params.items() if v)
    return base.rstrip("/") + "/#scalars&" + frag


def wait_for_data(base, run, tag, timeout):
    """Block until TensorBoard has a scalar matching `tag` for `run` (any run when None)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base.rstrip("/") + "/data/plugin/scalars/tags", timeout=5) as r:
                tags = json.load(r)
            if any(re.search(tag, t) for name, ts in tags.items() if run in (None, name) for t in ts):
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"Error: TensorBoard at {base} has no {tag!r} scalars for run "
                             f"{run or '(any)'} after {timeout:.0f}s")
        time.sleep(0.5)


def screenshot(url, out, chromium, size=(1400, 900), budget_ms=15000, timeout=120):
    """Render `url` and write the PNG `out`; raises RuntimeError if Chromium produced none."""
    profile = tempfile.mkdtemp(prefix="yarnapp-chromium-")
    out = os.path.abspath(out)
    if os.path.exists(out):
        os.unlink(out)
    cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={out}",
           f"--window-size={size[0]},{size[1]}", f"--virtual-time-budget={budget_ms}", url]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = b"(timed out)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # Chromium's helper processes share its session
        except ProcessLookupError:
            pass
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    if not os.path.isfile(out) or os.path.getsize(out) == 0:
        tail = "\n".join(output.decode(errors="replace").splitlines()[-5:])
        raise RuntimeError(f"Chromium wrote no screenshot (exit {proc.returncode}):\n{tail}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="application id, logdir (path or URI), or URL of a running TensorBoard")
    p.add_argument("-o", "--out", default="tensorboard.png", help="PNG to write (default: %(default)s)")
    p.add_argument("--run", help="run to select (default: the application id; else every run)")
    p.add_argument("--tag", default="loss", help="tags matching this regex come first (default: %(default)s)")
    p.add_argument("--chromium", default=find_chromium(), help="Chromium binary (default: found on PATH)")
    p.add_argument("--budget-ms", type=int, default=15000, help="virtual time the page gets to render")
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait for data and for Chromium")
    args = p.parse_args(argv)
    if not args.chromium:
        print("Error: no chromium on PATH (apt-get install chromium); or give --chromium", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from yarnapp.errors import YarnappError
    from yarnapp.tensorboard import for_app

    tb = None
    run = args.run
    try:
        if args.target.startswith(("http://", "https://")):
            base = args.target
        else:
            tb = for_app(args.target)
            base = tb.url
            if run is None and "/" not in args.target:
                run = args.target
        wait_for_data(base, run, args.tag, args.timeout)
        url = dashboard_url(base, run, args.tag)
        out = screenshot(url, args.out, args.chromium, budget_ms=args.budget_ms, timeout=args.timeout)
    except (YarnappError, RuntimeError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    finally:
        if tb is not None:
            tb.stop()
    print(f"{out}  ({url})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
