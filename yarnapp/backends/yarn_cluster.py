"""What the YARN backend reads from the cluster besides skein: its configuration
(HADOOP_CONF_DIR), the applications' storage on its default filesystem, and container
logs (live from the NodeManagers, aggregated through Hadoop's own `yarn logs`).

Why `yarn logs`: skein 0.8.2's `application_logs` reads the aggregated-log layout of
Hadoop before 3.3 (<remote-app-log-dir>/<user>/logs/<app>); Hadoop 3.3+ writes
<user>/bucket-logs-tfile/<bucket>/<app> (YARN-6929), where skein finds nothing and says
"Log aggregation has not completed or is not enabled" forever. Hadoop's own LogsCLI
reads every layout, so it is the fallback.
"""
import ctypes.util
import functools
import glob
import logging
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET

log = logging.getLogger(__name__)

STORAGE_DIR = ".yarnapp"          # <default FS>/user/<user>/.yarnapp/<app id>
LOGS_TIMEOUT = 60.0               # how long log aggregation may take after the end


def hadoop_conf(names=("core-site.xml", "hdfs-site.xml", "yarn-site.xml")):
    """The properties of the client's Hadoop configuration ($HADOOP_CONF_DIR); {} without one."""
    d = os.environ.get("HADOOP_CONF_DIR")
    out = {}
    for name in names:
        try:
            root = ET.parse(os.path.join(d, name)).getroot() if d else None
        except (OSError, ET.ParseError):
            continue
        for prop in root.iter("property") if root is not None else ():
            key, value = prop.findtext("name"), prop.findtext("value")
            if key:
                out[key.strip()] = (value or "").strip()
    return out


def counts_vcores():
    """Whether the cluster's scheduler counts vcores when it places containers, as its
    configuration here says: the capacity scheduler's DominantResourceCalculator does, its
    default (DefaultResourceCalculator) counts memory alone; the Fair scheduler, or no
    configuration to read: taken to count them."""
    d = os.environ.get("HADOOP_CONF_DIR")
    if not d or not os.path.isfile(os.path.join(d, "capacity-scheduler.xml")):
        return True
    if "FairScheduler" in hadoop_conf(("yarn-site.xml",)).get("yarn.resourcemanager.scheduler.class", ""):
        return True
    calculator = hadoop_conf(("capacity-scheduler.xml",)).get("yarn.scheduler.capacity.resource-calculator", "")
    return "DominantResourceCalculator" in calculator


def signed_in(user, conf=None):
    """`?user.name=USER` where the cluster's web UIs take who asks from the URL and refuse
    anonymous requests (simple HTTP authentication: the local Hadoop's): its proxied pages
    answered 401 without it. Else (Kerberos' SPNEGO, the browser's own; or anonymous): ''."""
    conf = hadoop_conf(("core-site.xml",)) if conf is None else conf
    simple = conf.get("hadoop.http.authentication.type") == "simple" and \
        conf.get("hadoop.http.authentication.simple.anonymous.allowed", "true").lower() == "false"
    return f"?user.name={user}" if simple and user else ""


def resourcemanager_unreachable(conf=None, timeout=5.0):
    """One line when the ResourceManager of the client's configuration does not accept a
    connection (not started, a wrong address), else None. Without it, skein's driver retried
    for as long as Hadoop's client does (yarn.resourcemanager.connect.max-wait.ms: 15
    minutes) and a command printed nothing meanwhile. Not checked without a configuration,
    or with ResourceManager HA (the client tries each)."""
    import socket
    conf = hadoop_conf(("yarn-site.xml",)) if conf is None else conf
    if not os.environ.get("HADOOP_CONF_DIR") or conf.get("yarn.resourcemanager.ha.enabled", "").lower() == "true":
        return None
    host = conf.get("yarn.resourcemanager.hostname") or "0.0.0.0"
    address = conf.get("yarn.resourcemanager.address") or "${yarn.resourcemanager.hostname}:8032"
    address = address.replace("${yarn.resourcemanager.hostname}", host)
    name, _, port = address.rpartition(":")
    try:
        socket.create_connection((name or host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        return (f"cannot reach YARN's ResourceManager at {address} (yarn.resourcemanager.address in "
                f"{os.environ['HADOOP_CONF_DIR']}/yarn-site.xml): {getattr(e, 'strerror', None) or e}; "
                f"is it running? (the local one: `yarnapp hadoop status`)")
    return None


def libhdfs_available():
    """Whether pyarrow's HadoopFileSystem could load libhdfs here (where pyarrow looks)."""
    dirs = [os.environ.get("ARROW_LIBHDFS_DIR"),
            os.environ.get("HADOOP_HOME") and os.path.join(os.environ["HADOOP_HOME"], "lib", "native")]
    if any(d and glob.glob(os.path.join(d, "libhdfs.so*")) for d in dirs):
        return True
    return ctypes.util.find_library("hdfs") is not None


def default_fs_uri(conf=None):
    """The cluster's default filesystem as a URI training.fsutil opens: hdfs:// where libhdfs
    loads, else the NameNode's WebHDFS (webhdfs://HTTP-ADDRESS); None without a configuration."""
    conf = hadoop_conf() if conf is None else conf
    fs = conf.get("fs.defaultFS") or conf.get("fs.default.name")
    if not fs:
        return None
    u = urllib.parse.urlparse(fs)
    if u.scheme != "hdfs" or libhdfs_available():
        return fs.rstrip("/")
    # (9870: training.fsutil.NAMENODE_PORTS, not imported: a client without pyarrow submits too)
    http = conf.get("dfs.namenode.http-address") or f"{u.hostname}:9870"
    host, _, port = http.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = u.hostname
    return f"webhdfs://{host}:{port}"


def python_uri(uri, conf=None):
    """An hdfs:// URI of the default filesystem as training.fsutil can open it here (webhdfs://
    when libhdfs cannot be loaded); other URIs unchanged."""
    conf = hadoop_conf() if conf is None else conf
    fs = (conf.get("fs.defaultFS") or "").rstrip("/")
    if fs and uri.startswith(fs + "/") and not libhdfs_available():
        return default_fs_uri(conf) + uri[len(fs):]
    return uri


def default_storage(user, conf=None):
    """Where applications keep what outlives them: <default FS>/user/<user>/.yarnapp."""
    base = default_fs_uri(conf)
    return f"{base}/user/{user}/{STORAGE_DIR}" if base else None


# ---- logs ----

def live_log(container, user, timeout=10):
    """A running container's log, read from its NodeManager's web services; None if unreachable.
    `container` is a skein Container (its service log is <service>.log)."""
    addr = container.yarn_node_http_address
    url = (f"http://{addr}/ws/v1/node/containers/{container.yarn_container_id}/logs/"
           f"{container.service_name}.log?user.name={urllib.parse.quote(user)}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return log_contents(r.read()).decode(errors="replace")
    except (OSError, urllib.error.URLError, ValueError) as e:
        log.debug("live log of %s unreachable: %s", container.id, e)
        return None


def log_contents(page):
    """The log itself (bytes) out of a NodeManager's page of it: a header (Container:,
    LogType:, LogLastModifiedTime:, LogLength:, LogContents:) and a footer (End of
    LogType:...) that change as the log grows; `logs --follow`, which prints what is new
    after what it printed, printed the whole page again at every look. LogLength bytes
    follow the header (with rolling log aggregation a copy aggregated so far comes after
    the footer: left out)."""
    start = page.find(b"LogContents:\n")
    if start < 0:
        return page
    header, body = page[:start], page[start + len(b"LogContents:\n"):]
    length = re.search(rb"^LogLength:\s*(\d+)\s*$", header, re.MULTILINE)
    if length:
        return body[:int(length.group(1))]
    end = body.find(b"End of LogType:")
    return body[:end] if end >= 0 else body


_CONTAINER = re.compile(r"^Container: (container_\S+) on \S+", re.MULTILINE)
_LOG_BODY = re.compile(r"^LogType:(\S+)\n(?:Log\w+:.*\n)*LogContents:\n(.*?)\nEnd of LogType:\1", re.MULTILINE | re.DOTALL)


def parse_yarn_logs(text):
    """`yarn logs` output -> {yarn container id: "LogType:<file>" and the contents of each of
    its log files}, the shape skein's application_logs gives."""
    out = {}
    starts = [(m.start(), m.group(1)) for m in _CONTAINER.finditer(text)] + [(len(text), None)]
    for (start, cid), (end, _) in zip(starts, starts[1:]):
        bodies = [f"LogType:{name}\n{body}" for name, body in _LOG_BODY.findall(text[start:end])]
        if bodies:
            out[cid] = (out[cid] + "\n" if cid in out else "") + "\n".join(bodies)
    return out


def aggregated_logs(app_id, user, timeout=LOGS_TIMEOUT):
    """{yarn container id: text} of a finished application through Hadoop's `yarn logs`,
    waiting (at most `timeout` s) for the NodeManagers to finish aggregating."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["yarn", "logs", "-applicationId", app_id, "-appOwner", user,
                              "-log_files_pattern", r".*\.log"], capture_output=True, text=True, timeout=120)
        logs = parse_yarn_logs(out.stdout)
        if out.returncode == 0 and logs and "Log aggregation has not completed" not in out.stdout:
            return logs
        if time.monotonic() > deadline:
            detail = (out.stderr.strip().splitlines() or out.stdout.strip().splitlines() or ["no output"])[-1]
            raise TimeoutError(f"`yarn logs` had no logs of {app_id} after {timeout:.0f}s ({detail})")
        time.sleep(2)


SERVICE_FAILED = "Failure in service "         # skein's diagnostics of an application it ended
_SERVICE_FAILED = re.compile(r"skein\.ApplicationMaster: FAILED: (\S+) - ([^\n]+)")   # ... and its log's why
SERVICE_LOG_WAIT_S = 20.0


@functools.cache        # once per application: `yarn logs` is a JVM's start, and status is asked again and again
def service_failure(app_id, user):
    """Why skein's master ended an application when no agent of it could say (every one of
    its containers killed at once: a container of a one-container job killed by its
    NodeManager for memory), from the master's log ("FAILED: w_0 - 1.6 GB of 512 MB physical
    memory used"): its failure record, or None where the log has no such line."""
    from launcher import memory
    from launcher.failure import Failure, Kind
    try:
        logs = aggregated_logs(app_id, user, timeout=SERVICE_LOG_WAIT_S)
    except Exception as e:  # noqa: BLE001 - the diagnostics' line stands
        log.debug("no master log of %s: %s", app_id, e)
        return None
    found = next((m for _, text in sorted(logs.items()) for m in _SERVICE_FAILED.finditer(text)), None)
    if found is None:
        return None
    container, words = found.group(1), found.group(2).strip()
    killed = memory.yarn_memory_kill(words, None, container, container.rsplit("_", 1)[0])
    return Failure(kind=Kind.CONTAINER.value, container=container,
                   reason=killed or f"{container}'s container failed: {words}").as_dict()
