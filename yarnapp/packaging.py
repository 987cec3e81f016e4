"""Ship the Python environment to YARN containers.

`environment_archive(job.environment)` returns what the YARN backend localizes as
``environment`` (an archive YARN unpacks into the container's working directory), or
None when the containers use the cluster's own ``python3``:

    archive: PATH-OR-URI   shipped as is (a local file is uploaded at submit; hdfs://...
                           and other URIs are referenced in place). Wins over `packer`.
    packer: venv-pack      this virtual environment, packed with venv-pack's Python API
    packer: conda-pack     this conda environment, packed with conda-pack (imported lazily)
    packer: none           no archive; the cluster's python3 must have yarnapp installed

Packed archives are cached under ``~/.cache/yarnapp/envs`` (``$YARNAPP_HOME/cache/envs``
when YARNAPP_HOME is set; ``$XDG_CACHE_HOME`` is honoured), keyed by a hash of what is
installed: every distribution's name, version and RECORD (the file hashes pip wrote), so
reinstalling changed code repacks while an unchanged environment is packed once.

What the archive must contain: the containers run ``environment/bin/python -m
launcher.agent``, so yarnapp itself (conf, yarnapp, launcher, training) must be
*installed* in the environment with ``pip install .`` -- not ``pip install -e .``: an
editable install points back at this machine's source tree, which containers cannot
see, so packing refuses it. A venv's ``bin/python`` links to the interpreter the venv
was created from; the same Python must exist at that path on every node (venv-pack's
own rule). conda-pack archives carry their interpreter and have no such requirement.
"""
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import urllib.parse

from .errors import YarnappError

log = logging.getLogger(__name__)

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")  # what YARN unpacks


def cache_dir():
    """yarnapp's client-side cache: $YARNAPP_HOME/cache when set, else ~/.cache/yarnapp."""
    if os.environ.get("YARNAPP_HOME"):
        return os.path.join(os.environ["YARNAPP_HOME"], "cache")
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "yarnapp")


def environment_archive(environment, cache=None, pack=True):
    """The archive to localize as `environment` for a conf Environment, or None (packer none).
    pack=False: the path the packed archive has (or will have), packing nothing."""
    if environment.archive:
        return ready_archive(environment.archive)
    if environment.packer == "venv-pack":
        return pack_venv(cache=cache, pack=pack)
    if environment.packer == "conda-pack":
        return pack_conda(cache=cache, pack=pack)
    return None


def ready_archive(value):
    """Check a user-given archive (path or URI) and return the source to ship."""
    url = urllib.parse.urlparse(value)
    if not any(url.path.endswith(s) for s in ARCHIVE_SUFFIXES):
        raise YarnappError(f"environment.archive: YARN unpacks only {', '.join(ARCHIVE_SUFFIXES)} "
                           f"archives; got {value!r}")
    if url.scheme in ("", "file"):
        path = os.path.abspath(os.path.expanduser(url.path if url.scheme else value))
        if not os.path.isfile(path):
            raise YarnappError(f"environment.archive: no such file {path!r}")
        return path
    return value


def pack_venv(prefix=None, cache=None, pack=True):
    """Pack a virtual environment (default: the running one) with venv-pack; return the archive path."""
    if prefix is None:
        if sys.prefix == sys.base_prefix:
            raise YarnappError(f"environment.packer: venv-pack packs a virtual environment, but this Python "
                               f"({sys.prefix}) is not one; give environment.archive (a ready .tar.gz) "
                               f"or set packer: none to use the cluster's python3")
        prefix = sys.prefix
    prefix = os.path.abspath(prefix)
    if not os.path.isfile(os.path.join(prefix, "pyvenv.cfg")):
        raise YarnappError(f"environment.packer: {prefix} is not a virtual environment (no pyvenv.cfg); "
                           f"give environment.archive or set packer: none")
    _refuse_editable(prefix, "venv-pack")
    import venv_pack  # lazy: only when packing

    def run(output):
        try:
            venv_pack.pack(prefix=prefix, output=output, force=True)
        except venv_pack.VenvPackException as e:
            raise YarnappError(f"environment.packer: venv-pack cannot pack {prefix}: {_one_line(e)}") from None
    return _cached(prefix, "venv", run, cache, pack)


def pack_conda(prefix=None, cache=None, pack=True):
    """Pack a conda environment (default: the running one) with conda-pack; return the archive path."""
    prefix = os.path.abspath(prefix or os.environ.get("CONDA_PREFIX") or sys.prefix)
    if not os.path.isdir(os.path.join(prefix, "conda-meta")):
        raise YarnappError(f"environment.packer: {prefix} is not a conda environment (no conda-meta); "
                           f"use packer: venv-pack, give environment.archive, or set packer: none")
    _refuse_editable(prefix, "conda-pack")
    try:
        import conda_pack
    except ImportError:
        raise YarnappError("environment.packer: conda-pack is not installed here; "
                           "`pip install conda-pack` (or conda install conda-pack), "
                           "or give environment.archive") from None

    def run(output):
        try:
            conda_pack.pack(prefix=prefix, output=output, force=True)
        except conda_pack.CondaPackException as e:
            raise YarnappError(f"environment.packer: conda-pack cannot pack {prefix}: {_one_line(e)}") from None
    return _cached(prefix, "conda", run, cache, pack)


def environment_key(prefix):
    """A hash of what is installed in `prefix` (name, version and RECORD of each distribution)."""
    h = hashlib.sha256(os.path.abspath(prefix).encode())
    for name, version, record in sorted(_distributions(prefix)):
        h.update(f"\0{name}\0{version}\0".encode())
        h.update((record or "").encode())
    for meta in sorted(glob.glob(os.path.join(prefix, "conda-meta", "*.json"))):
        h.update(os.path.basename(meta).encode())
    return h.hexdigest()


def _site_packages(prefix):
    return glob.glob(os.path.join(prefix, "lib", "python*", "site-packages"))


def _distributions(prefix):
    for dist in importlib.metadata.distributions(path=_site_packages(prefix)):
        yield dist.metadata["Name"] or "", dist.version or "", dist.read_text("RECORD")


def _refuse_editable(prefix, packer):
    editable = []
    for dist in importlib.metadata.distributions(path=_site_packages(prefix)):
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if info.get("dir_info", {}).get("editable"):
            editable.append(f"{dist.metadata['Name']} from {info.get('url', '?')}")
    if editable:
        raise YarnappError(f"environment.packer: {packer} would ship editable installs that point at this "
                           f"machine ({'; '.join(sorted(editable))}); reinstall them with `pip install .` "
                           f"(not -e), or give environment.archive")


def _cached(prefix, kind, run, cache, pack=True):
    cache = cache or os.path.join(cache_dir(), "envs")
    name = f"{kind}-{os.path.basename(prefix.rstrip(os.sep)) or 'root'}-{environment_key(prefix)[:16]}.tar.gz"
    path = os.path.join(cache, name)
    if not pack:
        return path
    os.makedirs(cache, exist_ok=True)
    if os.path.isfile(path):
        log.info("environment %s unchanged; reusing %s", prefix, path)
        return path
    tmp = os.path.join(cache, f".{name}.{os.getpid()}.tar.gz")
    log.info("packing %s into %s (%s)", prefix, path, kind)
    try:
        run(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _one_line(exc):
    return " ".join(str(exc).split())
