"""`yarnapp` commands about what jobs run on rather than a job itself: importing datasets
(`data import`), faults on a running application's emulated nodes (`netem`), and the local
single-node Hadoop (`hadoop`). Errors as in yarnapp.cli: one `Error: ...` line."""
import json
import os
import shlex
import sys
import time

import conf

from .console import as_json, p as _p
from .errors import UsageError, YarnappError


def cmd_clean(args):
    """Remove finished applications of the local engine (yarnapp.api.clean)."""
    from . import api
    if bool(args.apps) == (args.older_than is not None):
        args._parser.error("give the applications to remove, or --older-than DURATION (e.g. 7d; 0: every "
                           "finished one)")
    try:
        removed = api.clean(args.apps, args.older_than, dry_run=args.dry_run)
    except YarnappError as e:
        if str(e).startswith("older_than "):
            raise UsageError(str(e).replace("older_than ", "--older-than ", 1)) from None
        raise
    verb = "would remove" if args.dry_run else "removed"
    for app_id, name, state, size in removed:
        _p(f"{verb} {app_id}  {name:<16} {state:<10} {_mib(size)}")
    if not removed:
        _p(f"nothing to remove: no finished application older than {args.older_than}", file=sys.stderr)
    elif len(removed) > 1:
        _p(f"{verb} {len(removed)} applications, {_mib(sum(r[3] for r in removed))}")
    return 0


def _mib(size):
    return f"{size / 2**20:.1f} MiB"


def cmd_netem(args):
    """Fault injection on a running application's emulated nodes (local engine)."""
    from launcher import keys

    from .backends.local import netem
    net = netem.for_app(args.app)
    name = args.node.removeprefix("node")
    if not name.isdigit():
        raise UsageError(f"--node: expected a node number or name such as 1 or node1, got {args.node!r}")
    i = int(name)
    if args.cut:
        net.cut(i)
        netem.app_store(args.app).put(keys.cut(net.node_name(i)), json.dumps({"time": time.time()}))
        what = "link cut"
    elif args.restore:
        net.restore(i)
        netem.app_store(args.app).delete(keys.cut(net.node_name(i)))
        what = "link restored"
    else:
        try:
            delay = None if args.latency in ("0", "none") else conf.parse_duration_s(args.latency)
        except ValueError as e:
            raise UsageError(f"--latency: {e}") from None
        net.set_latency(i, delay)
        what = f"latency {args.latency}"
    _p(f"{args.app} {net.node_name(i)} ({net.addr(i)}): {what}; link {'up' if net.link_up(i) else 'down'}")
    return 0


def cmd_data_import(args):
    from training import data
    opts = {k: v for k, v in vars(args).items() if k in ("shards", "seed", "n_train", "n_test", "num_classes",
                                                         "path", "encoding", "quality", "classes") and v is not None}
    if args.overwrite:
        opts["overwrite"] = True
    if args.kind in ("arrays", "image-folder") and "path" not in opts:
        raise YarnappError(f"data import {args.kind}: give --path ("
                           f"{'an .npz with x and y' if args.kind == 'arrays' else 'the folder, a subfolder per class'})")
    if args.kind == "image-folder":
        opts["folder"] = opts.pop("path")
    summary = data.run_import(args.kind, args.uri, opts,         # DataError: one line, naming the flag
                              spell=lambda k: "--" + ("path" if k == "folder" else k).replace("_", "-"))
    _p(as_json(summary))
    return 0


def cmd_hadoop(args):
    """A local single-node Hadoop (HDFS + YARN) for trying the YARN backend (yarnapp.hadoop)."""
    from . import hadoop
    memory = None
    if args.memory is not None:
        try:
            memory = conf.parse_memory_mib(args.memory)
        except ValueError as e:
            raise UsageError(f"--memory: {e}") from None
    cluster = hadoop.LocalHadoop(args.dir, port_base=args.port_base, vcores=args.vcores, memory_mb=memory)
    if args.action == "start":
        if not args.quiet:
            _p(f"starting Hadoop {hadoop.version()} in {cluster.root} (the first start fetches its jars "
               f"through Maven)", file=sys.stderr)
        took = cluster.start()
        what = "started" if took["started"] else "already running"
        _p(f"local Hadoop {what}: HDFS {cluster.default_fs} (WebHDFS {cluster.webhdfs}), YARN "
           f"{cluster.rm_web} in {took['start_s']:.1f}s; `eval \"$(yarnapp hadoop env)\"` to use it",
           file=sys.stderr)
    elif args.action == "stop":
        stopped = cluster.stop()
        _p(f"stopped {', '.join(stopped)}" if stopped else "the local Hadoop was not running", file=sys.stderr)
    elif args.action == "status":
        st = cluster.status()
        if args.json:
            _p(as_json(st, indent=1))
        elif not os.path.isdir(cluster.conf_dir):
            _p(f"no local Hadoop in {cluster.root} yet; `yarnapp hadoop start"
               f"{' --dir ' + shlex.quote(args.dir) if args.dir else ''}` makes and starts it")
        else:
            up = [n for n, pid in st["daemons"].items() if pid]
            _p(f"{st['root']}: Hadoop {st['version']}; running: {', '.join(up) or 'nothing'}; "
               f"HDFS {'ready' if st['hdfs_ready'] else 'not ready'}, YARN "
               f"{'ready' if st['yarn_ready'] else 'not ready'}; {st['default_fs']} (WebHDFS {st['webhdfs']})")
        return 0 if all(st["daemons"].values()) else 3
    else:
        for k, v in cluster.environ().items():
            _p(f"export {k}={shlex.quote(v)}")
        if not os.path.isdir(cluster.conf_dir):     # printed anyway: a shell profile may eval it first
            _p(f"note: no local Hadoop in {cluster.root} yet; `yarnapp hadoop start"
               f"{' --dir ' + shlex.quote(args.dir) if args.dir else ''}` makes and starts it", file=sys.stderr)
    return 0
