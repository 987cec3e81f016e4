"""`yarnapp` command line (its exit statuses: README.md). Expected errors print one
`Error: ...` line and exit 1: every YarnappError (conf.errors, the one root), and an
OSError that names a path it could not open (a file the user named, or one the command
must write); a wrong argument (argparse's, or a flag's value it cannot take: UsageError)
is one line too, with exit status 2. Anything else is a bug and keeps its traceback."""
import argparse
import difflib
import errno
import logging
import os
import re
import tempfile
import sys
import time

import conf

from . import __version__, api, cli_job, interrupts
from .backends.base import TERMINAL
from .console import as_json, p as _p, say, stdout_gone
from .cli_tools import cmd_clean, cmd_data_import, cmd_hadoop, cmd_netem
from .cli_wait import cmd_wait, ended, watch
from .logview import cmd_logs
from .errors import UsageError, YarnappError


def cmd_submit(args):
    spec = cli_job.load(args, backend=args.backend, max_restarts=args.max_restarts,
                        checkpoint=None if args.resume is None else {"resume": args.resume},
                        network=None if args.nodes is None else {"nodes": args.nodes})
    if args.dry_run:
        if args.wait:
            raise UsageError("--wait: a --dry-run starts nothing to wait for; give one of them")
        try:
            _p(api.dry_run(spec, where=args.job), end="")
        except YarnappError as e:
            raise cli_job.flagged(args, e) from None
        return 0
    interrupts.sigterm_stops_command()         # `kill` or `timeout` stops a submit as Ctrl-C does
    t0, out = time.time(), sys.stdout
    try:
        run = api.start(spec, where=args.job, setting=cli_job.setting(args))
    except YarnappError as e:
        raise cli_job.flagged(args, e) from None
    try:
        app_id = run.app_id
        if not args.wait:
            _p(app_id)
            return 0
        out = say(f"submitted {app_id} to the {spec.backend} backend: {spec.world_size} ranks in "
                  f"{len(spec.groups)} groups ({', '.join(f'{g.instances}x{g.name}' for g in spec.groups)})", out)
        st, streamed, out = watch(run, "Ctrl-C kills it")      # --wait ties the job to this command
    except KeyboardInterrupt:
        if not args.wait:
            raise                   # submitted without --wait: it runs on, as it would have
        interrupts.shielded(run.kill)      # a second Ctrl-C cut the kill's line short ("interrupted" alone)
        say(f"interrupted: killed {run.app_id}{run.resume_hint(cli_job.resubmit(args))}", sys.stderr)     # (as errors)
        return interrupts.command_interrupted_status()
    return ended(run, st, time.time() - t0, streamed, out, resubmit=cli_job.resubmit(args))


def cmd_status(args):
    st = api.Run(args.app).status()
    if args.json:
        _p(as_json(st, indent=1, default=str))
        return 0
    _p(f"{st['app_id']}  {st['name']}  {st['state']}  {st.get('diagnostics') or ''}".rstrip())
    if st.get("tensorboard"):
        _p(f"tensorboard: {st.get('tensorboard_open') or st['tensorboard']}")
    failure = (st.get("failure") or {}) if st["state"] == "FAILED" else {}
    masters = st.get("am_attempts") or []
    if len(masters) > 1:        # a container's attempts= count its starts under this master
        _p(f"  application master attempt {masters[-1]['attempt']} (pid {masters[-1]['pid']}): every container "
           f"started again under it")
    if st.get("supervisor_lost") and st["state"] not in TERMINAL:
        _p("  warning: its supervisor was killed from outside: should its application master die, no other "
           "attempt starts")
    for c in st.get("containers", []):
        peak = f" (peak {c['memory_peak_mib']} MiB)" if c.get("memory_peak_mib") else ""
        if c.get("gpu_devices"):        # which (their indices), not how many
            peak += f"  GPU{'s' if len(c['gpu_devices']) > 1 else ''} {','.join(str(g) for g in c['gpu_devices'])}"
        res = (f"  {c['vcores']:g} vcores {c['memory_mib']} MiB{peak}  [{c['resources']}]" if "vcores" in c
               else "") + (f"  {c['node']}" if c.get("node") else "") + \
            (f" ({c['addr']})" if c.get("addr") else "")     # YARN's host, or an emulated node and its address
        code = "-" if c["exit_code"] is None else str(c["exit_code"])
        own = failure.get("exit_code") if c["id"] == failure.get("container") else None
        if isinstance(own, int) and own > 0 and own != c["exit_code"]:     # a rank's sys.exit(3): its container's 1
            code += f" (its rank's {own})"
        _p(f"  {c['id']:<14} rank {'-' if c.get('rank') is None else c['rank']!s:<4} {c['state']:<10} exit={code} "
           f"attempts={c['attempts']}{' slot=' + c['slot'] if c.get('slot') else ''}{res}".rstrip())
        if c.get("exit"):
            _p(f"    {c['exit']}")
        elif c["id"] == failure.get("container") and failure.get("reason"):    # beside the others' "failed elsewhere"
            _p(f"    the application failed here: {failure['reason']}")
        if c.get("memory_kill"):
            _p(f"    {c['memory_kill']}")
    for r in st.get("restarts") or []:
        _p(f"  restart {r.get('generation')}: {r.get('reason')}"
           + (" (spends no restart)" if r.get("external") else ""))
    from .progress import final_model, metrics, notice
    for n in st.get("notices") or []:
        _p("  " + notice(n))
    p = (st.get("progress") or {}).get(0)
    if p:
        _p("  progress: " + metrics(p, skip=("rank", "time")))
    if st.get("final"):
        _p("  final: " + metrics(st["final"]))
    model = final_model(st)
    if model:
        _p("  " + model)
    return 0


def cmd_kill(args):
    run = api.Run(args.app)
    before = run.status()["state"]
    st = run.kill()     # (an application that ended: what of it may still run, its supervisor stopped)
    if before in TERMINAL:          # (not said as if this kill had ended it)
        _p(f"{args.app} had already ended {before}; nothing of it runs")
        return 0
    hint = run.resume_hint(cli_job.submitted_as(st)) if st["state"] == "KILLED" else ""
    _p(f"{args.app} {st['state']}{hint}")
    return 0


def cmd_list(args):
    if args.json:
        _p(as_json(api.list_apps(args.backend), indent=1, default=str))
        return 0
    for a in api.list_apps(args.backend):
        _p(f"{a['app_id']}  {a['name']:<16} {a['state']:<10} {a.get('diagnostics') or ''}".rstrip())
    return 0


def cmd_tensorboard(args):
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: give a port from 1 to 65535, or 0 for a free one")
    from . import tensorboard
    interrupts.sigterm_stops_command()
    if "/" in args.app and "://" not in args.app and not os.path.isdir(args.app):
        if os.path.exists(args.app):
            raise YarnappError(f"{args.app} is a file; give a logdir (a directory or URI) or an application id")
        _p(f"note: {args.app} does not exist (yet); TensorBoard shows its runs once they are written there",
           file=sys.stderr)
    tb = tensorboard.for_app(args.app, port=args.port)
    try:
        _p(tb.url)
        _p(f"TensorBoard on {tb.logdir}; Ctrl-C stops it", file=sys.stderr)
        rc = tb.wait()
    except KeyboardInterrupt:       # Ctrl-C: what stops it (0); `kill`/`timeout`: as a shell gives (143)
        return 143 if interrupts.command_terminated() else 0
    finally:
        tb.stop()
    raise YarnappError(f"TensorBoard exited with status {rc}")


def cmd_plan(args):
    """Predicted step time and speedup of every strategy for a job (training.planner)."""
    spec = cli_job.load(args)
    from training import planner   # its measuring modules import torch on first use, not these checks
    # PlanError, ModelError, DataError are YarnappErrors: main() prints them as one line.
    try:
        planner.check_plannable(spec)
    except YarnappError as e:
        raise YarnappError(f"{args.job}: {e}") from None
    opts = planner.parse_options(measure=args.measure, bandwidth=args.bandwidth, latency=args.latency,
                                 machines=args.machines, gpu_speed=args.gpu_speed, quick=args.quick,
                                 input_shape=args.input_shape, classes=args.classes)
    args.json = args.json and _output_file("--json", args.json, "plan.json")    # before minutes of measuring
    args.png = args.png and _output_file("--png", args.png, "plan.png")
    from . import preflight, shipping
    preflight.check_model(spec, args.job)
    interrupts.sigterm_stops_command()        # its probes, co-runners and busy processes are stopped
    shipment = shipping.plan(conf.absolutize(spec, os.getcwd()), args.job)
    busy = os.getloadavg()[0]              # other work's, before the plan's own probes add theirs
    with shipping.importable(shipment):     # a model of the job's own, as it ships
        plan = planner.plan_job(spec, opts)
    said = sys.stderr if args.json == "-" else sys.stdout      # (stdout: the JSON alone)
    _p(planner.format_table(plan), file=said)
    cores = os.cpu_count() or 1
    if busy > 0.75 * cores:     # an audit's plan at load 3-4 on 2 cores: rank 0 alone 568 ms (322 quiet), 2.80x for 2x the CPU
        _p(f"note: this machine was busy when the plan measured (load average {busy:.1f} on {cores} cores before it "
           f"started): its timings, and so these predictions, can be far off; plan again when it is quieter", file=said)
    try:                            # what submit would refuse, said beside the predictions
        m = plan["model"]
        preflight.check_strategy(spec, (m["input_shape"], m["classes"]), shipment)
    except YarnappError as e:
        _p(f"note: the job's own strategy, {spec.training.strategy.name}, cannot run this model ({e}): submit "
           f"refuses it as it is", file=said)
    if args.json == "-":
        _p(as_json(plan, indent=1))
    elif args.json:
        _p(f"written {planner.write_json(plan, args.json)}")
    if args.png:
        _p(f"written {planner.write_png(plan, args.png)}", file=said)
    return 0


def _output_file(flag, path, example):
    """The file `flag` will write, checked now: not a directory, in one that exists and
    takes a new file, of a kind it can write. A plot's name without an extension gets
    .png, as matplotlib adds it (the plan said it wrote the name it was given)."""
    if path == "-" and flag == "--json":
        return path                 # stdout
    if os.path.isdir(path):
        raise YarnappError(f"{flag} {path}: is a directory; give a file name, e.g. {os.path.join(path, example)}")
    ext = os.path.splitext(path)[1].lower()
    if flag == "--png":
        if not ext:
            path, ext = path + ".png", ".png"
        from matplotlib.backend_bases import FigureCanvasBase
        kinds = set(FigureCanvasBase.get_supported_filetypes()) & {      # not .pgf: it needs LaTeX
            "png", "svg", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp"}
        if ext[1:] not in kinds:
            raise YarnappError(f"{flag} {path}: cannot draw a {ext} file; give a name ending in .png "
                               f"(or {', '.join('.' + k for k in sorted(kinds) if k != 'png')})")
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        raise YarnappError(f"{flag} {path}: directory {where} does not exist; create it or give another path")
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".yarnapp-"):
            pass
    except OSError as e:
        raise YarnappError(f"{flag} {path}: cannot create a file in {where} ({e.strerror or e}); give a "
                           f"writable path") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise YarnappError(f"{flag} {path}: cannot write it (permission denied); give a writable path")
    return path


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong argument is one line naming the command, the closest command
    to a misspelt one, and where the usage is (argparse prints the usage, then the error)."""

    def error(self, message):
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if bad:
            close = difflib.get_close_matches(bad.group(1), re.findall(r"'([^']*)'", bad.group(2)), n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        self.exit(2, f"Error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def _job_fields(s):
    """`submit`'s and `plan`'s KEY=VALUE fields of the job (yarnapp.cli_job, conf.overrides)."""
    s.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="set a field of the job, read as YAML "
                   "reads it: training.epochs=3 training.lr=0.01 groups.big.instances=2 (a group by name or index)")


def build_parser():
    p = _Parser(prog="yarnapp", description="Train CNNs on YARN or the embedded local engine.")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the client does")
    p.add_argument("--version", action="version", version=f"yarnapp {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("submit", help="start an application from a job.yaml")
    s.add_argument("job", help="path of the job.yaml")
    _job_fields(s)
    s.add_argument("--backend", choices=["local", "yarn"], help="overrides the job's backend")
    s.add_argument("--max-restarts", type=int, help="overrides the job's max_restarts")
    s.add_argument("--wait", action="store_true", help="show progress until it ends; non-zero exit if it fails; Ctrl-C or SIGTERM kills the application")
    s.add_argument("--nodes", type=int, help="overrides the job's network.nodes (emulated nodes; local engine, root)")
    s.add_argument("--dry-run", action="store_true", dest="dry_run",
                   help="print what would be submitted (YARN: the skein.ApplicationSpec YAML; local: the "
                        "resolved job) and start nothing")
    s.add_argument("--resume", metavar="never|latest|APP_ID",
                   help="overrides checkpoint.resume: where a new application starts from")
    s.set_defaults(fn=cmd_submit)

    s = sub.add_parser("status", help="an application's state, containers, restarts and progress")
    s.add_argument("app", help="application id (`yarnapp list` shows them)")
    s.add_argument("--json", action="store_true", help="everything status knows, as JSON")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("logs", help="container logs")
    s.add_argument("app", help="application id (`yarnapp list` shows them)")
    s.add_argument("--container", help="one container, e.g. big_0 (`yarnapp status` lists them), or master: "
                   "the application master's log")
    s.add_argument("--follow", "-f", action="store_true", help="keep printing until the application ends; the "
                   "exit status is then 0 if it SUCCEEDED, else 1 (as submit --wait's)")
    s.add_argument("--tail", "-n", type=int, metavar="N", help="only the last N lines of each log (with --follow: "
                   "then what comes)")
    s.set_defaults(fn=cmd_logs)

    s = sub.add_parser("wait", help="wait for an application to end, as submit --wait does; exit status 0 if it "
                       "SUCCEEDED, 1 if it failed or was killed, 124 after --timeout")
    s.add_argument("app", help="application id (`yarnapp submit` without --wait prints it)")
    s.add_argument("--timeout", metavar="DURATION", help="stop waiting after this long (e.g. 30m), exit status 124; "
                   "the application runs on, as it does after Ctrl-C here")
    s.set_defaults(fn=cmd_wait)

    s = sub.add_parser("kill", help="stop an application; nothing of it keeps running")
    s.add_argument("app", help="application id (`yarnapp list` shows them)")
    s.set_defaults(fn=cmd_kill)

    s = sub.add_parser("list", help="applications, newest first")
    s.add_argument("--backend", default="local", choices=["local", "yarn"],
                   help="whose applications: the local engine's (default) or the YARN cluster's")
    s.add_argument("--json", action="store_true", help="one JSON list of the applications' records (app_id, name, "
                   "state, submitted, diagnostics; on YARN, their status records), for scripts")
    s.set_defaults(fn=cmd_list)

    s = sub.add_parser("clean", help="remove finished applications of the local engine (logs, files, and the "
                       "checkpoints and TensorBoard runs kept in them)",
                       description="Remove finished applications' directories under YARNAPP_HOME: their logs, "
                       "store, staged files, and the checkpoints and TensorBoard runs kept there. A job's own "
                       "checkpoint.uri and tensorboard.logdir are left alone. YARN keeps and deletes its "
                       "applications' logs itself.")
    s.add_argument("apps", nargs="*", metavar="APP", help="applications to remove (`yarnapp list` shows them)")
    s.add_argument("--older-than", dest="older_than", metavar="DURATION",
                   help="every application that ended more than this long ago, e.g. 7d or 12h (0: every "
                        "finished one)")
    s.add_argument("--dry-run", action="store_true", dest="dry_run", help="say what would be removed; remove nothing")
    s.set_defaults(fn=cmd_clean)

    s = sub.add_parser("tensorboard", help="serve an application's TensorBoard (every run of its logdir) until Ctrl-C")
    s.add_argument("app", help="application id, or a logdir (path or URI) to serve directly")
    s.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    s.set_defaults(fn=cmd_tensorboard)

    s = sub.add_parser("netem", help="fault injection on a running application's emulated nodes")
    s.add_argument("app")
    s.add_argument("--node", required=True, help="node number or name, e.g. 1 or node1")
    a = s.add_mutually_exclusive_group(required=True)
    a.add_argument("--cut", action="store_true", help="take the node's link down (a partition)")
    a.add_argument("--restore", action="store_true", help="bring the node's link back up")
    a.add_argument("--latency", metavar="DELAY", help="one-way delay on the node's link, e.g. 50ms (0: none)")
    s.set_defaults(fn=cmd_netem)

    s = sub.add_parser("plan", help="predict each strategy's step time and speedup for a job; recommend one")
    s.add_argument("job", help="path of the job.yaml")
    _job_fields(s)
    s.add_argument("--measure", action="store_true", help="measure the job's link with an MPI ping-pong (2 "
                   "processes) even where --bandwidth or network.bandwidth is given (without either, it is "
                   "measured anyway)")
    s.add_argument("--bandwidth", help="link rate(s), e.g. 1gbit or 1gbit,10gbit (simulated clusters use all)")
    s.add_argument("--latency", help="one-way latency of a --bandwidth link and of the simulated clusters, e.g. "
                   "0.05ms (default: the job's link's: network.latency or 0.05ms with a bandwidth, else measured)")
    s.add_argument("--machines", default="1,2,4,8,16", help="simulated cluster sizes, at most 512 (default 1,2,4,8,16)")
    s.add_argument("--gpu-speed", type=float, dest="gpu_speed",
                   help="also simulate one GPU this many times faster than rank 0's container, plus CPUs")
    s.add_argument("--quick", action="store_true", help="time each layer briefly (fast, noisier)")
    s.add_argument("--input-shape", dest="input_shape", help="CxHxW when the job's data cannot be read")
    s.add_argument("--classes", type=int, help="classes when the job's data cannot be read (default 10)")
    s.add_argument("--png", help="write a plot of predicted speedup against machines (.png added to a name "
                                 "without an extension)")
    s.add_argument("--json", help="write the whole plan as JSON to this file; - : to stdout (the table then on stderr)")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("hadoop", help="a local single-node Hadoop (HDFS + YARN) to try --backend yarn on",
                       description="A local single-node Hadoop (HDFS + YARN) to try --backend yarn on. `status` "
                                   "exits 0 where every daemon runs, else 3.")
    s.add_argument("action", choices=["start", "stop", "status", "env"],
                   help="env prints the exports a shell needs (eval \"$(yarnapp hadoop env)\")")
    s.add_argument("--dir", help="the cluster's directory (default $YARNAPP_HOME/hadoop, else ~/.yarnapp/hadoop)")
    s.add_argument("--port-base", type=int, dest="port_base",
                   help="fixed ports are base+20, 70, 30-33, 88 (default 28000, or the cluster's own)")
    s.add_argument("--vcores", type=int, help="vcores the NodeManager advertises (default 16, or the cluster's own)")
    s.add_argument("--memory", help="memory the NodeManager advertises (default 16 GiB, or the cluster's own)")
    s.add_argument("--json", action="store_true", help="status as JSON")
    s.add_argument("--quiet", "-q", action="store_true", help="start: no line before the jars are fetched")
    s.set_defaults(fn=cmd_hadoop)

    d = sub.add_parser("data", help="datasets").add_subparsers(dest="data_cmd", required=True, metavar="ACTION")
    s = d.add_parser("import", help="write a dataset as Parquet shards to a URI")
    s.add_argument("kind", choices=["digits", "synthetic-cifar", "arrays", "image-folder"])
    s.add_argument("uri", help="destination: a path or any pyarrow URI (file://, hdfs://...)")
    s.add_argument("--shards", type=int, help="Parquet files per dataset (default: synthetic-cifar 4, the others 2)")
    s.add_argument("--seed", type=int, help="synthetic-cifar: the seed of its images (default 0)")
    s.add_argument("--n-train", type=int, dest="n_train", help="synthetic-cifar: training images (default 10000)")
    s.add_argument("--n-test", type=int, dest="n_test", help="synthetic-cifar: test images (default 2000)")
    s.add_argument("--num-classes", type=int, dest="num_classes",
                   help="arrays: the number of classes (default: the largest label + 1)")
    s.add_argument("--path", help="arrays: an .npz with x (uint8, N x C x H x W, or N x H x W) and y (integer "
                   "labels); image-folder: the folder (a subfolder per class)")
    s.add_argument("--classes", help="image-folder: the class names in label order, separated by commas (default: "
                   "the sorted subfolders); give a test folder its training set's, e.g. bird,cat,dog, where it "
                   "lacks a class")
    s.add_argument("--encoding", choices=["raw", "jpeg", "png"],
                   help="synthetic-cifar: raw pixels (default) or image files (image-folder keeps its files)")
    s.add_argument("--quality", type=int, help="synthetic-cifar --encoding jpeg: JPEG quality (default 90)")
    s.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset (a directory of Parquet shards; anything else there is refused)")
    s.set_defaults(fn=cmd_data_import)
    _name_leaves(p)
    return p


def _name_leaves(parser):
    """Each subcommand's parser in its own namespace (`_parser`), so that an argument it does
    not know is refused naming it and its --help (`main`), not the top-level one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_parser=sub)
                _name_leaves(sub)


def _joined_negatives(argv):
    """`--older-than -1d` as `--older-than=-1d`: argparse takes a value like '-1d' (not a
    plain negative number) for an option and says only "expected one argument"; joined, it
    reaches the option's own check, which says what it expects."""
    out = []
    for arg in argv:
        if out and re.match(r"-\d", arg) and out[-1].startswith("--") and out[-1] != "--" and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv=None):
    interrupts.command_started()    # (a SIGTERM that stopped an earlier main() in this process: forgotten)
    import signal
    if getattr(signal.getsignal(signal.SIGINT), "yarnapp_importing", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)    # Ctrl-C from here on: "interrupted" below
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        args, extra = parser.parse_known_args(_joined_negatives(list(argv)))
        args.argv = argv                    # as typed (a hint that puts the job's file first keeps the rest)
        if hasattr(args, "overrides"):      # KEY=VALUE after an option (`job.yaml --wait a=1`) comes as extra
            args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
            extra = [x for x in extra if x not in args.overrides]
        if extra:
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args) or 0
    except KeyboardInterrupt:       # Ctrl-C (or `kill`, where the command turns it into one)
        print("interrupted", file=sys.stderr, flush=True)
        return interrupts.command_interrupted_status()
    except BrokenPipeError:         # `yarnapp status APP | head -1`: the reader is gone, as after SIGPIPE
        stdout_gone()
        return 141
    except YarnappError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, UsageError) else 1
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        if not e.filename:          # not a path the user gave: a bug, with its traceback
            raise
        print(f"Error: {e.filename}: {e.strerror}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:
        if e.errno not in _STORAGE_ERRNOS:      # (a bug, with its traceback)
            raise
        from .backends.local.state import home
        ours = args.cmd not in ("data", "plan", "hadoop")      # (those write where they are told)
        where = e.filename or (f"a disk yarnapp writes to (its applications' under YARNAPP_HOME, {home()})" if ours
                               else "the disk this command writes to")
        advice = _STORAGE_ERRNOS[e.errno]
        if not ours or e.filename and not os.path.realpath(e.filename).startswith(os.path.realpath(home()) + os.sep):
            advice = advice.split(" (")[0].split(", or set YARNAPP_HOME")[0]    # (a path of the command's own)
        print(f"Error: {where}: {e.strerror}: {advice}", file=sys.stderr, flush=True)
        return 1


# A disk yarnapp writes to (YARNAPP_HOME's, or a path the command was given) full or read-only
_STORAGE_ERRNOS = {errno.ENOSPC: "free space there (`yarnapp clean --older-than 7d` removes old applications), "
                                 "or set YARNAPP_HOME to another disk",
                   errno.EDQUOT: "free space within your quota there, or set YARNAPP_HOME to another disk",
                   errno.EROFS: "remount it writable, or set YARNAPP_HOME to a writable directory"}


if __name__ == "__main__":
    sys.exit(main())
