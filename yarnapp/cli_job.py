"""The job a command names, and how to submit it again: its file, the fields its
command line sets (`KEY=VALUE`, conf.overrides; --nodes, --max-restarts, --backend), errors
that name what gave a bad value, and the `yarnapp submit ...` line that a failure's or a
kill's resume hint ends with."""
import os
import re
import shlex

import conf
import conf.overrides

from . import api
from .errors import YarnappError


def flagged(args, e):
    """A flag's or a KEY=VALUE's bad value: the error names its field and what gave it
    (checked when the job is read, or later: --nodes more than the containers, when the
    nodes are made)."""
    flags = [(field, f"{flag} {value}") for field, flag, value in (
        ("checkpoint.resume", "--resume", getattr(args, "resume", None)),
        ("network.nodes", "--nodes", getattr(args, "nodes", None)),
        ("max_restarts", "--max-restarts", getattr(args, "max_restarts", None))) if value is not None]
    head = f"{args.job}: "
    field, _, what = str(e)[len(head):].partition(": ")
    if not str(e).startswith(head) or not what:
        return e

    def within(a, b):       # `a` is the field `b`, or a field of it (or an entry of its list)
        return a == b or a.startswith((b + ".", b + "["))
    for path, given in flags + sorted(getattr(args, "given", {}).items(), key=lambda kv: -len(kv[0])):
        if within(field, path):
            return YarnappError(f"{head}{field} (given as {given}): {what}")
    sub = re.match(r"([A-Za-z_][A-Za-z0-9_.]*): ", what)     # `groups[0].env: FOO: a boolean`
    if sub:
        for path, given in getattr(args, "given", {}).items():
            if within(f"{field}.{sub.group(1)}", path):
                return YarnappError(f"{head}{field} (given as {given}): {what}")
        return e
    # A check of a whole section (`groups: duplicate group name` after groups.0.name=...)
    inside = [given for path, given in getattr(args, "given", {}).items() if within(path, field)]
    if inside:
        return YarnappError(f"{head}{field} (with {', '.join(inside)} on the command line): {what}")
    return e


def load(args, **flags):
    """The job of `args.job` with the command line's KEY=VALUE fields set (conf.overrides)
    and `flags` over it; errors name the file, and what on the command line gave the field."""
    args.given = {}
    try:
        job = args.job
        if "=" in str(job) and not os.path.exists(job):     # `yarnapp submit a=1 job.yaml`
            file = next((a for a in args.overrides if "=" not in a), "JOB.yaml")
            at = args.argv.index(args.cmd) + 1          # (the command's flags kept: main's args.argv)
            again = args.argv[:at] + [file] + [a for a in args.argv[at:] if a != file]
            raise YarnappError(f"{job}: not a job file; give the job's file first, then its fields: "
                               f"{shlex.join(['yarnapp', *again])}")
        if args.overrides:
            where, raw = conf.read_raw(args.job)
            job, args.given = conf.overrides.apply(raw, args.overrides, where)
        return api.spec_of(job, args.job, flags)
    except conf.JobError as e:
        raise YarnappError(str(e)) from None
    except YarnappError as e:
        raise flagged(args, e) from None


def resubmit(args):
    """The command that submitted this job, to submit it again (a failure's line adds
    `--resume APP_ID`)."""
    return shlex.join(["yarnapp", "submit", args.job, *setting(args)])


def setting(args):
    """The arguments of `yarnapp submit` after the job's file that set its fields."""
    out = list(args.overrides)
    for flag, value in (("--backend", args.backend), ("--max-restarts", args.max_restarts), ("--nodes", args.nodes)):
        if value is not None:
            out += [flag, str(value)]
    return out


def submitted_as(st):
    """The command that submits an application's job again, from here (`cd DIR && yarnapp
    submit job.yaml`: its relative paths, data and code, are from where it was submitted)."""
    job = st.get("job_file")        # the file it was submitted from (the local engine keeps it)
    where = st.get("submit_dir") or os.getcwd()
    cd = f"cd {shlex.quote(where)} && " if job and os.path.realpath(where) != os.path.realpath(os.getcwd()) else ""
    if job:
        rel = os.path.relpath(job, where)
        job = shlex.quote(job if rel.startswith("..") else rel)
    return f"{cd}yarnapp submit {job or 'JOB.yaml'}{''.join(' ' + shlex.quote(a) for a in st.get('setting') or [])}"
