"""Apache Hadoop's own distribution for the local Hadoop (yarnapp.hadoop): the version
`conf/hadoop/pom.xml` pins, its jars fetched from Maven Central once through
`mvn dependency:copy-dependencies` into ``<yarnapp cache>/hadoop-<version>/lib``, and the
Java that runs them.
"""
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time

import conf

from . import packaging
from .errors import YarnappError

log = logging.getLogger("yarnapp.hadoop")

POM = os.path.join(os.path.dirname(conf.__file__), "hadoop", "pom.xml")


class HadoopError(YarnappError):
    """The local Hadoop cannot start or stop; the message says why and what to do."""


class HadoopUnavailable(HadoopError):
    """What it needs is missing here: Java, Maven, or Maven Central (the jars' download)."""


FETCH_TIMEOUT = 900.0


def version():
    with open(POM) as f:
        return re.search(r"<hadoop.version>([^<]+)</hadoop.version>", f.read()).group(1)


def jars_dir():
    return os.path.join(packaging.cache_dir(), f"hadoop-{version()}", "lib")


def java_home():
    if os.environ.get("JAVA_HOME") and os.path.isfile(os.path.join(os.environ["JAVA_HOME"], "bin", "java")):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    if not java:
        raise HadoopUnavailable("no Java found: Hadoop needs a JDK (17 is what yarnapp's local Hadoop is tested "
                          "with); install one or set JAVA_HOME")
    return os.path.dirname(os.path.dirname(os.path.realpath(java)))


def fetch_jars():
    """Hadoop's jars in the cache, fetched through Maven on first use; returns (dir, seconds spent)."""
    dest = jars_dir()
    if os.path.isfile(os.path.join(dest, ".complete")):
        return dest, 0.0
    mvn = shutil.which("mvn")
    if not mvn:
        raise HadoopUnavailable(f"no Maven (`mvn`) on PATH: it fetches Hadoop {version()}'s jars from Maven "
                          f"Central once; install Maven (e.g. apt-get install maven)")
    java_home()
    t0 = time.monotonic()
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    work = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(dest))
    try:
        shutil.copy(POM, os.path.join(work, "pom.xml"))
        try:
            out = subprocess.run([mvn, "-B", "-q", "dependency:copy-dependencies", "-DincludeScope=runtime",
                                  f"-DoutputDirectory={work}/lib"], cwd=work, capture_output=True, text=True,
                                 env=dict(os.environ, JAVA_HOME=java_home()), timeout=FETCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise HadoopUnavailable(f"Maven did not fetch Hadoop {version()}'s jars within "
                                    f"{FETCH_TIMEOUT:.0f}s (is Maven Central reachable?)") from None
        if out.returncode != 0:
            errors = [line for line in (out.stdout + out.stderr).splitlines() if "ERROR" in line]
            raise HadoopUnavailable(f"Maven could not fetch Hadoop {version()}'s jars (exit {out.returncode}): "
                              f"{(errors or ['no output'])[0].strip()[:300]}")
        open(os.path.join(work, "lib", ".complete"), "w").close()
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(os.path.join(work, "lib"), dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    took = time.monotonic() - t0
    log.info("fetched Hadoop %s's jars into %s in %.1fs", version(), dest, took)
    return dest, took
