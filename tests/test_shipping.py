"""Shipping the user's code (yarnapp.shipping): what goes, under which names, what is
refused; and the skein spec of a job with shipped files, validated by skein itself."""
import importlib
import json
import os
import sys
import threading
import zipfile

import pytest
import skein

import conf
from yarnapp import shipping
from yarnapp.backends.yarn import build_spec, stage_files
from yarnapp.errors import YarnappError

pytestmark = pytest.mark.unit


def _project(root):
    """A user's project: a script, a helper module beside it, a package, some junk."""
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("import helper\n")
    (root / "helper.py").write_text("X = 1\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"junk")
    return root


def _job(run, backend="local", environment=None, env=None):
    return conf.absolutize(conf.load_job({"name": "own", "groups": [{"name": "w", "instances": 2, "env": env or {}}],
                                          "backend": backend, "environment": environment or {"packer": "none"},
                                          "run": dict(run, editable=False)}), os.getcwd())


def test_a_script_ships_its_own_directory_and_runs_from_the_copy(tmp_path, monkeypatch):
    proj = _project(tmp_path / "proj")
    s = shipping.plan(_job({"script": str(proj / "train.py"), "args": ["--lr", "0.1"]}))
    assert s.entries == {"proj": str(proj)}
    # submitted from elsewhere: it runs in the working directory, where proj/ lands
    assert s.job.run.script == "proj/train.py" and s.job.run.files == ["proj"]
    monkeypatch.chdir(proj)     # submitted from its directory: it runs in proj/ (files null), as `python train.py`
    assert shipping.plan(_job({"script": str(proj / "train.py")})).job.run.files is None
    assert s.job.run.args == ["--lr", "0.1"]
    dest = tmp_path / "container"
    shipping.copy_into(s.entries, str(dest))
    assert sorted(os.listdir(dest / "proj")) == ["helper.py", "pkg", "train.py"]     # no __pycache__


def test_listed_files_ship_under_their_names_and_a_script_outside_them_too(tmp_path):
    proj = _project(tmp_path / "proj")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "main.py").write_text("")
    s = shipping.plan(_job({"script": str(other / "main.py"),
                            "files": [str(proj / "pkg"), str(proj / "helper.py")]}))
    assert s.entries == {"pkg": str(proj / "pkg"), "helper.py": str(proj / "helper.py"),
                         "main.py": str(other / "main.py")}
    assert s.job.run.script == "main.py"
    assert s.job.run.files == ["helper.py", "main.py", "pkg"]       # listed: it runs in the working directory


def test_clashes_missing_files_and_data_sized_trees_are_refused_in_one_line(tmp_path):
    a, b = tmp_path / "a" / "util", tmp_path / "b" / "util"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    with pytest.raises(YarnappError, match=r"run.files: .* would both land as 'util'"):
        shipping.plan(_job({"function": "m:f", "files": [str(a), str(b)]}))
    with pytest.raises(YarnappError, match="run.files: .*nope does not exist"):
        shipping.plan(_job({"function": "m:f", "files": [str(tmp_path / "nope")]}))
    big = tmp_path / "data"
    big.mkdir()
    with open(big / "blob.bin", "wb") as f:
        f.truncate(shipping.LIMIT_BYTES + 2**20)
    with pytest.raises(YarnappError, match="data holds 201 MiB, more than the 200 MiB of code"):
        shipping.plan(_job({"function": "m:f", "files": [str(big)]}))


def test_a_module_of_the_users_named_as_yarnapps_own_packages_is_refused_where_imported(tmp_path):
    """A conf.py beside the script: every rank has yarnapp's conf imported before the script
    runs, so its `import conf` got yarnapp's, and every rank failed with an AttributeError."""
    import shutil
    import subprocess
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "conf.py").write_text("LR = 0.1\n")
    (proj / "train.py").write_text("import helper\n")
    (proj / "helper.py").write_text("from conf import LR\n")
    with pytest.raises(YarnappError) as e:
        shipping.plan(_job({"script": str(proj / "train.py")}))
    assert str(e.value) == (f"run.script: {proj / 'conf.py'} is named as yarnapp's own package 'conf', which every "
                            f"rank imports before your code, so `import conf` in {proj / 'helper.py'} would get "
                            f"yarnapp's; rename your module (say, my_conf)")
    (proj / "helper.py").write_text("import config\n")          # not imported: no clash
    assert shipping.plan(_job({"script": str(proj / "train.py")})).entries == {"proj": str(proj)}
    # in the working directory it would shadow yarnapp's own for the launcher, imported or not
    with pytest.raises(YarnappError, match=rf"^run.files: {proj / 'conf.py'} would land as 'conf.py' in the "
                                           rf"containers' working directory, where it would shadow yarnapp's own "
                                           rf"package 'conf' for yarnapp's launcher itself; rename it"):
        shipping.plan(_job({"script": str(proj / "train.py"), "files": [str(proj / "conf.py")]}))
    (proj / "launcher").mkdir()                                  # a folder, not a package: no clash
    assert shipping.plan(_job({"script": str(proj / "train.py"), "files": [str(proj / "launcher"),
                                                                           str(proj / "helper.py")]}))
    (proj / "conf.py").unlink()                                  # a copy of yarnapp's own package: no clash
    shutil.copytree(os.path.dirname(importlib.util.find_spec("training").origin), proj / "training")
    (proj / "train.py").write_text("from training import dist\n")
    assert shipping.plan(_job({"script": str(proj / "train.py")})).entries == {"proj": str(proj)}
    # a training/ package of the project's own, its __init__.py empty: was taken for a copy of
    # yarnapp's (whose was empty too), and every rank failed on "No module named 'training.loop'"
    shutil.rmtree(proj / "training")
    (proj / "training").mkdir()
    (proj / "training" / "__init__.py").write_text("")
    (proj / "training" / "loop.py").write_text("def fit():\n    return 1\n")
    (proj / "train.py").write_text("from training.loop import fit\n")
    (proj / "job.yaml").write_text("name: p\ngroups: [{name: w, instances: 1, vcores: 0.5, memory: 512 MiB}]\n"
                                   "run: {script: train.py}\n")
    line = (f"run.script: {proj / 'training'} is named as yarnapp's own package 'training', which every rank "
            f"imports before your code, so `import training` in {proj / 'train.py'} would get yarnapp's; rename "
            f"your module (say, my_training)")
    with pytest.raises(YarnappError) as e:
        shipping.plan(_job({"script": str(proj / "train.py")}))
    assert str(e.value) == line
    # `python -m yarnapp.cli` there (the project's training/ first on sys.path): the same line, no traceback
    out = subprocess.run([sys.executable, "-m", "yarnapp.cli", "submit", "job.yaml", "--dry-run"], cwd=proj,
                         capture_output=True, text=True, env={**os.environ, "YARNAPP_HOME": str(tmp_path / "home")})
    assert out.returncode == 1 and out.stderr == f"Error: job.yaml: {line}\n", out.stderr
    shutil.rmtree(proj / "training")
    # a notebook's own conf.py in its directory: `import yarnapp` there says what shadows what
    (tmp_path / "conf.py").write_text("LR = 0.1\n")
    out = subprocess.run([sys.executable, "-c", "import yarnapp"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"ImportError: {tmp_path / 'conf.py'} shadows yarnapp's own package 'conf' (in "
        f"{os.path.dirname(os.path.dirname(conf.__file__))}): rename it, or import yarnapp from another directory")
    # a plain conf/ directory (a Hydra-style folder of YAML files) is no package: it shadows
    # nothing, under an editable install (README's, whose import hook runs after sys.path:
    # launcher/__init__.py) as under a plain one
    (tmp_path / "conf.py").unlink()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("lr: 0.1\n")
    out = subprocess.run([sys.executable, "-c", "import yarnapp, conf; print(conf.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == conf.__file__
    # ... nor in a container, shipped to its working directory (on PYTHONPATH there)
    out = subprocess.run([sys.executable, "-c", "import launcher.rank, conf; print(conf.__file__)"], cwd="/",
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == conf.__file__


def test_code_shipped_under_the_name_of_pythons_own_module_is_refused_where_it_would_meet_it(tmp_path):
    """`run.files: [code]` with `run.function: code.train:main`: Python's `code` was imported
    first and the rank failed with "No module named 'code.train'; 'code' is not a package".
    A random.py or a package would shadow Python's own for every import; a script's folder
    named like one, without __init__.py and not imported by name, is fine."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("def main(ctx):\n    pass\n")
    with pytest.raises(YarnappError, match=rf"^run.files: {code} would be imported as 'code' in the containers, "
                                           rf"the name of Python's own module code; rename it"):
        shipping.plan(_job({"function": "code.train:main", "files": [str(code)]}))
    assert shipping.plan(_job({"script": str(code / "train.py")})).entries == {"code": str(code)}
    (tmp_path / "random.py").write_text("SEED = 1\n")
    with pytest.raises(YarnappError, match="would be imported as 'random'"):
        shipping.plan(_job({"script": str(code / "train.py"), "files": [str(code), str(tmp_path / "random.py")]}))


def test_what_a_job_ships_is_importable_here_while_the_planner_builds_its_model(tmp_path, monkeypatch):
    """`yarnapp plan` of a job whose model ships with run.files said "cannot import
    mynets.nets (No module named 'mynets'); install it, or ship it with the job" though
    submit ran it: the planner imports it here, and its probes in processes of their own."""
    import subprocess
    pkg = tmp_path / "proj" / "mynets"
    pkg.mkdir(parents=True)
    (pkg / "nets.py").write_text("WIDTH = 8\n")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    before = list(sys.path)
    shipment = shipping.plan(_job({"function": "mynets.nets:WIDTH", "files": [str(pkg)]}))
    with shipping.importable(shipment):
        assert importlib.import_module("mynets.nets").WIDTH == 8
        child = subprocess.run([sys.executable, "-c", "import mynets.nets as n; print(n.WIDTH)"],
                               capture_output=True, text=True, cwd=tmp_path)
        assert child.stdout == "8\n", child.stderr
    assert sys.path == before and "PYTHONPATH" not in os.environ
    assert "mynets" not in sys.modules and "mynets.nets" not in sys.modules     # imported afresh next time


def test_the_local_engines_own_directories_are_never_shipped(tmp_path, monkeypatch):
    proj = _project(tmp_path / "proj")
    home = proj / "yarnapp-home"
    (home / "apps" / "app_1").mkdir(parents=True)
    monkeypatch.setenv("YARNAPP_HOME", str(home))
    s = shipping.plan(_job({"script": str(proj / "train.py")}))
    dest = tmp_path / "container"
    shipping.copy_into(s.entries, str(dest))
    assert "yarnapp-home" not in os.listdir(dest / "proj")


def test_editable_installs_are_found_from_their_distribution_metadata(tmp_path, monkeypatch):
    """A real distribution on sys.path, marked editable in its direct_url.json (PEP 610),
    as `pip install -e` leaves it; its src-layout package is what ships."""
    src = tmp_path / "myproj" / "src" / "mylib"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "core").mkdir()
    (src / "core" / "__init__.py").write_text("")
    site = tmp_path / "site"
    info = site / "mylib-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mylib\nVersion: 0.1\n")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": (tmp_path / "myproj").as_uri(), "dir_info": {"editable": True}}))
    monkeypatch.syspath_prepend(str(site))
    found = shipping.editable_packages()
    assert found["mylib"] == str(src)
    assert "yarnapp" not in found and "training" not in found         # the product is not the user's
    job = _job({"function": "mylib:main"})
    s = shipping.plan(job.model_copy(update={"run": job.run.model_copy(update={"editable": True})}))
    assert s.entries["mylib"] == str(src)


def test_the_skein_spec_of_a_job_with_shipped_files_lists_them_and_skein_accepts_it(tmp_path):
    proj = _project(tmp_path / "proj")
    (tmp_path / "fn.pkl").write_bytes(b"pickled")
    s = shipping.plan(_job({"script": str(proj / "train.py"), "files": [str(proj), str(proj / "helper.py")]},
                           backend="yarn"))
    staging = tmp_path / "staging"
    staging.mkdir()
    files = stage_files(s.job, str(staging), shipped=s.entries)
    spec = build_spec(s.job, files)
    for service in spec.services.values():
        assert set(service.files) == {"job.json", ".yarnapp-secret", "proj", "helper.py"}
        assert service.files["proj"].type == skein.FileType.ARCHIVE     # YARN unpacks it as proj/
        assert service.files["helper.py"].type == skein.FileType.FILE
    archive = service.files["proj"].source.removeprefix("file://")
    assert sorted(zipfile.ZipFile(archive).namelist()) == ["helper.py", "pkg/", "pkg/__init__.py", "train.py"]
    assert skein.ApplicationSpec.from_yaml(spec.to_yaml()).to_dict() == spec.to_dict()
    shipped = json.loads((staging / "job.json").read_text())
    assert shipped["run"]["script"] == "proj/train.py"


def test_a_pickled_function_ships_as_function_pkl_and_a_file_that_is_no_pickle_is_refused(tmp_path):
    import pickle
    (tmp_path / "f.pkl").write_bytes(pickle.dumps(len, protocol=2))
    s = shipping.plan(_job({"pickle": str(tmp_path / "f.pkl")}))
    assert s.entries == {"function.pkl": str(tmp_path / "f.pkl")} and s.job.run.pickle == "function.pkl"
    (tmp_path / "notes.txt").write_text("x")        # it failed in the containers, naming function.pkl
    with pytest.raises(YarnappError, match=rf"^run.pickle: {tmp_path / 'notes.txt'} is not a pickle; give a file "
                                           rf"written with cloudpickle.dump\(function, f\)"):
        shipping.plan(_job({"pickle": str(tmp_path / "notes.txt")}))


def test_a_script_runs_in_a_private_copy_of_a_directory_yarn_shares_read_only(tmp_path):
    """YARN localizes a shipped directory once per node, read-only, linked into every
    container: the script runs in a writable copy of its own (launcher.user_code.private_copy);
    a directory the container owns (the local engine's copy) is used as it is."""
    from launcher.user_code import private_copy
    cache = _project(tmp_path / "filecache" / "proj")
    for path in (cache / "train.py", cache / "helper.py", cache):
        os.chmod(path, 0o500)
    work = tmp_path / "container"
    work.mkdir()
    (work / "proj").symlink_to(cache)
    mine = private_copy(str(work / "proj"), str(work))
    assert mine == str(work / ".run-proj") and sorted(os.listdir(mine)) == sorted(os.listdir(cache))
    with open(os.path.join(mine, "out.txt"), "w") as f:       # relative writes: in its own copy
        f.write("x")
    open(os.path.join(mine, "helper.py"), "a").close()
    assert not os.path.exists(cache / "out.txt")
    owned = work / "own"
    owned.mkdir()
    assert private_copy(str(owned), str(work)) == str(owned)
    os.chmod(cache, 0o700)


def test_a_function_that_cannot_be_shipped_is_one_line_naming_it(yarnapp_home, monkeypatch):
    """What a notebook function captures goes with it. A lock gave a bare TypeError; a large
    captured array said `run.files: /tmp/yarnapp-fn-.../function.pkl holds 250 MiB`, naming a
    field never set and a file the user never saw. Nothing is started either way."""
    import threading

    import yarnapp
    lock = threading.Lock()
    big = bytes(3 * 2**20)
    monkeypatch.setattr(shipping, "LIMIT_BYTES", 2 * 2**20)       # 3 MiB over a 2 MiB limit, not 200 MiB

    def locked(ctx):
        with lock:
            pass

    def captures(ctx):
        return len(big)
    job = {"name": "t", "groups": [{"name": "a", "instances": 1, "vcores": 1, "memory": "256 MiB"}]}
    with pytest.raises(YarnappError, match=r"^function: test_a_function_that_cannot_be_shipped_is_one_line_naming_it"
                                           r"\.<locals>\.locked cannot be pickled to ship it \(TypeError: cannot "
                                           r"pickle '_thread\.lock' object\): what it captures"):
        yarnapp.submit(job, function=locked)
    with pytest.raises(YarnappError, match=r"\.captures pickles to 3 MiB with what it captures \(its closure and the "
                                           r"globals it uses\), more than the 2 MiB"):
        yarnapp.submit(job, function=captures)

    def noarg():
        pass

    def two(ctx, lr):
        pass
    async def coro(ctx):
        pass

    def gen(ctx):
        yield ctx
    for f, kind, made in ((coro, "async def", "coroutine"), (gen, "generator", "generator")):
        with pytest.raises(YarnappError, match=rf"^function: {kind} .*\.{f.__name__}: every rank calls "
                                               rf".*{f.__name__}\(ctx\), which only makes a {made} nobody runs; "):
            yarnapp.submit(job, function=f)
    for f in (noarg, two):
        with pytest.raises(YarnappError, match=rf"^function: .*\.{f.__name__}\(.*\) cannot be called with the "
                                               rf"RunContext alone; every rank calls it as .*{f.__name__}\(ctx\)"):
            yarnapp.submit(job, function=f)
    # submit(job, train), the function given where the backend goes: was "backend: Input should
    # be 'local' or 'yarn'"
    with pytest.raises(YarnappError, match=r"^submit: backend: got captures, a callable; pass the function by "
                                           r"name: submit\(job, function=captures\)$"):
        yarnapp.submit(job, captures)
    assert not os.path.isdir(os.path.join(yarnapp_home, "apps")) or os.listdir(os.path.join(yarnapp_home, "apps")) == []


def test_a_function_its_module_does_not_define_and_a_script_that_does_not_compile_are_refused(tmp_path):
    """Read, not run: before, the containers started and every rank failed on the import
    (`training.hello:mian`) or on the user's SyntaxError."""
    proj = tmp_path / "proj"
    (proj / "nets").mkdir(parents=True)
    (proj / "nets" / "__init__.py").write_text("")
    (proj / "nets" / "small.py").write_text(
        "import torch as _t\nfrom os import path as p\ndef build(ctx):\n    pass\ndef bare():\n    pass\n"
        "def bound(ctx, cfg):\n    pass\nbound = _t.nn.Module and bound\nasync def coro(ctx):\n    pass\n"
        "def gen(ctx):\n    if ctx:\n        yield 1\ndef build2(ctx):\n    def g():\n        yield 2\n    return list(g())\n"
        "try:\n    from fast import Net\nexcept ImportError:\n    class Net:\n        pass\n"
        "if p:\n    WIDTH, (DEPTH, _) = 3, (4, 5)\n")
    (proj / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    (proj / "star.py").write_text("from os.path import *\n")
    files = {"files": [str(proj / "nets"), str(proj / "lazy.py"), str(proj / "star.py")]}
    for defined in ("nets.small:build", "nets.small:bound", "nets.small:Net", "nets.small:DEPTH", "nets.small:p", "lazy:anything",
                    "star:join", "training.hello:main"):
        shipping.plan(_job({"function": defined, **files}))
    with pytest.raises(YarnappError) as e:
        shipping.plan(_job({"function": "nets.small:biuld", **files}))
    assert str(e.value) == (f"run.function: nets.small:biuld: module nets.small ({proj / 'nets' / 'small.py'}) "
                            f"has no 'biuld'; did you mean 'build'?")
    with pytest.raises(YarnappError) as e:       # every rank failed: bare() takes 0 positional arguments
        shipping.plan(_job({"function": "nets.small:bare", **files}))
    assert str(e.value) == ("run.function: nets.small:bare: bare() cannot be called with the RunContext alone; "
                            "every rank calls it as bare(ctx): give it one parameter (def bare(ctx): ...)")
    with pytest.raises(YarnappError, match=r"async def coro: every rank calls coro\(ctx\), which only makes a "
                                           r"coroutine nobody runs"):
        shipping.plan(_job({"function": "nets.small:coro", **files}))
    with pytest.raises(YarnappError, match=r"^run.function: nets.small:gen: generator gen: every rank calls "
                                           r"gen\(ctx\), which only makes a generator nobody runs; make it a plain def"):
        shipping.plan(_job({"function": "nets.small:gen", **files}))     # (a yield in a def inside: not one)
    shipping.plan(_job({"function": "nets.small:build2", **files}))
    with pytest.raises(YarnappError, match=r"^run.function: training.hello:mian: module training.hello \(.*hello.py\) "
                                           r"has no 'mian'; did you mean 'main'\?$"):
        shipping.plan(_job({"function": "training.hello:mian"}))
    with pytest.raises(YarnappError, match=r"^run.function: nets.smal:build: no module nets.smal \(no smal.py or "
                                           r"smal/ in .*nets\); check its name$"):
        shipping.plan(_job({"function": "nets.smal:build", **files}))
    (proj / "train.py").write_text("import os\nprint('x'\n")
    with pytest.raises(YarnappError, match=r"^run.script: .*train.py line 2: SyntaxError: .*; fix it, or run "
                                           r"`python -m py_compile .*train.py`$"):
        shipping.plan(_job({"script": str(proj / "train.py")}))


def test_a_module_neither_installed_nor_shipped_is_refused_and_one_beside_the_job_is_named(tmp_path, monkeypatch):
    """Before, such a job started its containers, which failed importing the module."""
    (tmp_path / "mymod.py").write_text("def main(ctx):\n    pass\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: own\n")
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(YarnappError) as e:
        shipping.plan(_job({"function": "mymod:main"}), where=str(job_file))
    assert str(e.value) == (f"{job_file}: run.function: mymod:main: no module named 'mymod' in this environment or "
                            f"in what the job ships; there is {tmp_path / 'mymod.py'}: add it to run.files")
    assert shipping.plan(_job({"function": "mymod:main", "files": [str(tmp_path / "mymod.py")]})).entries == {
        "mymod.py": str(tmp_path / "mymod.py")}
    (tmp_path / "pkg" / "sub.py").write_text("def main(ctx):\n    pass\n")
    assert shipping.plan(_job({"function": "pkg.sub:main", "files": [str(tmp_path / "pkg")]})).entries == {
        "pkg": str(tmp_path / "pkg")}
    assert shipping.plan(_job({"function": "training.hello:main"})).entries == {}     # installed
    with pytest.raises(YarnappError, match=r"^run.function: nowhere:main: no module named 'nowhere' .*; install it"):
        shipping.plan(_job({"function": "nowhere:main"}))
    def on_yarn(**environment):
        return shipping.plan(_job({"function": "nowhere:main"}, backend="yarn", environment=environment))
    with pytest.raises(YarnappError, match="no module named 'nowhere'"):
        on_yarn(packer="venv-pack")                         # this environment, packed
    assert on_yarn(packer="none") and on_yarn(packer="venv-pack", archive="hdfs:///envs/py311.tar.gz")
    src = tmp_path / "src"
    src.mkdir()
    (src / "nets.py").write_text("")
    with pytest.raises(YarnappError) as e:      # the working directory is on sys.path, not src/
        shipping.plan(_job({"function": "nets:main", "files": [str(src)]}))
    assert str(e.value).endswith(f"; it is in the shipped src/: name it src.nets:main, or ship {src / 'nets.py'} "
                                 f"itself"), str(e.value)


def test_a_module_only_on_this_processs_sys_path_is_not_the_containers(tmp_path, monkeypatch, yarnapp_home):
    """`python -m yarnapp.cli`, a notebook or a script has its own directory first on
    sys.path; the containers' interpreter does not. Before, a module there passed the check
    and every container failed importing it. Now it is refused as not shipped, and a
    function pickled here takes it by value (local_modules)."""
    name = "cwdmod_of_yarnapp_tests"
    (tmp_path / f"{name}.py").write_text("def main(ctx):\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")
    assert importlib.util.find_spec(name) is not None                  # this process finds it
    with pytest.raises(YarnappError, match=f"no module named '{name}' .*; there is {tmp_path / name}.py: add it"):
        shipping.plan(_job({"function": f"{name}:main"}))
    module = importlib.import_module(name)
    try:
        local = {m.__name__ for m in shipping.local_modules(shipping.plan(_job({"function": "training.hello:main"})))}
        assert name in local and not local & {"os", "json", "numpy", "torch", "yarnapp", "training"}, local
        shipped = _job({"function": "training.hello:main", "files": [str(tmp_path / f"{name}.py")]})
        on_path = _job({"function": "training.hello:main", "files": [str(tmp_path)]},     # its directory shipped,
                       env={"PYTHONPATH": tmp_path.name})                                  # on a group's PYTHONPATH
        for job in (shipped, on_path):
            assert name not in {m.__name__ for m in shipping.local_modules(shipping.plan(job))}
        (tmp_path / "lockmod_of_yarnapp_tests.py").write_text("import threading\nLOCK = threading.Lock()\n")
        locks = importlib.import_module("lockmod_of_yarnapp_tests")      # a module-level lock goes by value too

        def uses(ctx):
            return locks
        import yarnapp
        with pytest.raises(YarnappError, match=r"cannot pickle '_thread.lock' object.*; or ship "
                                               r"lockmod_of_yarnapp_tests in run\.files"):
            yarnapp.submit({"name": "t", "groups": [{"name": "a", "instances": 1}]}, function=uses)
        lock = threading.Lock()                     # the function's own lock: no module of this machine's to ship

        def own_lock(ctx):
            with lock:
                return 1
        with pytest.raises(YarnappError) as e:
            yarnapp.submit({"name": "t", "groups": [{"name": "a", "instances": 1}]}, function=own_lock)
        assert str(e.value).endswith("create such objects (locks, open files, connections) inside the function"), e
    finally:
        sys.modules.pop(module.__name__)
        sys.modules.pop("lockmod_of_yarnapp_tests", None)


def test_a_module_on_the_clients_pythonpath_is_not_on_yarns_containers(tmp_path, monkeypatch):
    """The local engine's containers inherit the client's environment, PYTHONPATH included;
    YARN's are given the groups' env only, so a module found through the client's
    PYTHONPATH is refused there, and a notebook function takes it by value."""
    name = "pathmod_of_yarnapp_tests"
    (tmp_path / f"{name}.py").write_text("def main(ctx):\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    shipping._fresh_interpreter.cache_clear()
    try:
        def job(backend):
            return _job({"function": f"{name}:main"}, backend=backend, environment={"packer": "venv-pack"})
        assert shipping.plan(job("local"))
        with pytest.raises(YarnappError, match=f"no module named '{name}'"):
            shipping.plan(job("yarn"))
        module = importlib.import_module(name)
        hello = {"function": "training.hello:main"}
        assert module not in shipping.local_modules(shipping.plan(_job(hello)))
        assert module in shipping.local_modules(shipping.plan(_job(hello, backend="yarn",
                                                                   environment={"packer": "venv-pack"})))
    finally:
        sys.modules.pop(name, None)
        shipping._fresh_interpreter.cache_clear()


def test_modules_on_a_groups_pythonpath_and_compiled_extensions_count_as_shipped(tmp_path, monkeypatch):
    """From the review: a group's env PYTHONPATH (absolute, or relative to the working
    directory where the shipped entries land) and a shipped compiled extension worked before
    the check, and still do."""
    lib, src = tmp_path / "lib", tmp_path / "src"
    lib.mkdir()
    src.mkdir()
    (lib / "mymod.py").write_text("def main(ctx):\n    pass\n")
    (src / "nets.py").write_text("def main(ctx):\n    pass\n")
    ext = tmp_path / f"fastops.cpython-{sys.version_info[0]}{sys.version_info[1]}-x86_64-linux-gnu.so"
    ext.write_bytes(b"")
    monkeypatch.chdir(tmp_path.parent)

    def job(function, env, files=None, backend="local"):
        return _job({"function": function, "files": files}, backend=backend, environment={"packer": "venv-pack"},
                    env=env)
    assert shipping.plan(job("mymod:main", {"PYTHONPATH": str(lib)}))
    assert shipping.plan(job("nets:main", {"PYTHONPATH": "src"}, files=[str(src)]))
    assert shipping.plan(job("nets:main", {"PYTHONPATH": "elsewhere"}))          # not known here: not refused
    assert shipping.plan(job("mymod:main", {"PYTHONPATH": "/opt/lib"}, backend="yarn"))     # the nodes' own
    with pytest.raises(YarnappError, match="no module named 'mymod'"):
        shipping.plan(job("mymod:main", {"PYTHONPATH": str(src)}))
    assert shipping.plan(job("fastops:main", {}, files=[str(ext)]))
    monkeypatch.chdir(src)          # the current directory shipped whole: the hint names the shipped copy
    with pytest.raises(YarnappError, match=r"it is in the shipped src/: name it src.nets:main"):
        shipping.plan(job("nets:main", {}, files=[str(src)]))


def test_a_module_beside_the_script_that_run_files_leave_out_is_refused_where_imported(tmp_path, monkeypatch):
    """`run.files: [train.py]` with `from mynet import Net` and mynet.py beside it: every rank
    failed with ModuleNotFoundError after the application started. Optional imports (in a
    `try`) and modules shipped or installed are not refused."""
    root = _project(tmp_path / "proj")
    (root / "train.py").write_text("import os\nfrom helper import X\ntry:\n    import pkg\nexcept ImportError:\n"
                                   "    pkg = None\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(YarnappError, match=rf"^run.files: {root}/train.py imports 'helper', and {root}/helper.py "
                                           rf"beside it is not shipped, so every rank would fail with "
                                           rf"ModuleNotFoundError; add it to run.files \(or leave run.files out"):
        shipping.plan(_job({"script": str(root / "train.py"), "files": [str(root / "train.py")]}))
    shipping.plan(_job({"script": str(root / "train.py"), "files": [str(root / "train.py"), str(root / "helper.py")]}))
    shipping.plan(_job({"script": str(root / "train.py")}))        # files null: the directory goes
    shipping.plan(_job({"script": str(root / "train.py"), "files": [str(root)]}))     # ... or listed
    yarn = _job({"script": str(root / "train.py"), "files": [str(root / "train.py")]}, backend="yarn")
    shipping.plan(yarn)             # the cluster's own interpreter: its modules are not known here
    (root / "train.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import helper\n")
    shipping.plan(_job({"script": str(root / "train.py"), "files": [str(root / "train.py")]}))
    (root / "train.py").write_text("from helper import X\n")
    (root / "helper.py").write_text("import pkg\n")               # a shipped module's own import, of a package
    with pytest.raises(YarnappError, match=rf"{root}/helper.py imports 'pkg', and {root}/pkg beside it"):
        shipping.plan(_job({"script": str(root / "train.py"), "files": [str(root / "train.py"),
                                                                         str(root / "helper.py")]}))


def test_a_function_importing_a_local_module_in_its_body_is_refused(yarnapp_home, tmp_path, monkeypatch):
    """`def f(ctx): import helpers` with a notebook's helpers.py beside it: pickled by value,
    the function ran its import in every rank, which failed with ModuleNotFoundError."""
    import yarnapp
    (tmp_path / "helpers_nb.py").write_text("def val():\n    return 41\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def f(ctx):
        import helpers_nb
        return helpers_nb.val()
    job = {"name": "t", "groups": [{"name": "a", "instances": 1, "vcores": 1, "memory": "256 MiB"}]}
    with pytest.raises(YarnappError, match=rf"^function: .*\.f imports 'helpers_nb' inside its body, and the "
                                           rf"containers cannot import it \({tmp_path}/helpers_nb.py\); import it at "
                                           rf"the top of your notebook or script instead"):
        yarnapp.submit(job, function=f)
    assert not os.path.isdir(os.path.join(yarnapp_home, "apps")) or os.listdir(os.path.join(yarnapp_home, "apps")) == []
    run = yarnapp.submit({**job, "run": {"files": [str(tmp_path / "helpers_nb.py")]}}, function=f)
    st = run.wait(timeout=120)
    assert st["state"] == "SUCCEEDED", run.logs()
    assert run.final == {"result": 41}


def test_a_relative_script_beside_the_job_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "train.py").write_text("print(1)\n")
    (tmp_path / "ddp" / "job.yaml").write_text("name: t\ngroups: [{name: w, instances: 1}]\nrun: {script: train.py}\n")
    monkeypatch.chdir(tmp_path)
    job = conf.absolutize(conf.load_job("ddp/job.yaml"), os.getcwd())
    with pytest.raises(YarnappError, match=rf"^ddp/job.yaml: run.script: {tmp_path}/train.py does not exist; there "
                                           rf"is {tmp_path}/ddp/train.py, but paths in a job file are relative to "
                                           rf"the directory you submit from: submit from {tmp_path}/ddp \(the job "
                                           rf"file's directory\)"):
        shipping.plan(job, "ddp/job.yaml")
    # a script in a directory of its own beside the job file: from the job file's directory,
    # not the script's (that said "submit from <dir>/other", from where it failed again)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "rel.py").write_text("print(1)\n")
    (tmp_path / "rel.yaml").write_text("name: t\ngroups: [{name: w, instances: 1}]\nrun: {script: other/rel.py}\n")
    monkeypatch.chdir(tmp_path / "other")
    job = conf.absolutize(conf.load_job("../rel.yaml"), os.getcwd())
    with pytest.raises(YarnappError, match=rf"there is {tmp_path}/other/rel.py, but paths in a job file are "
                                           rf"relative to the directory you submit from: submit from {tmp_path} "
                                           rf"\(the job file's directory\)"):
        shipping.plan(job, "../rel.yaml")


def test_the_apis_own_errors_leave_a_notebook_their_line_not_yarnapps_frames(yarnapp_home, tmp_path):
    """A notebook showed 3-6 frames of api.py and the engine (_started, start, checked,
    check_resources) above a YarnappError's one line: the error now leaves the API cut at the
    call the user made, whose frame IPython hides (__tracebackhide__). Our own bugs keep theirs."""
    import traceback

    import yarnapp
    job = {"name": "t", "groups": [{"name": "a", "instances": 1, "vcores": 4096, "memory": "256 MiB"}]}

    def train(ctx):
        pass
    with pytest.raises(YarnappError, match=r"vcores") as caught:      # said by the engine's check_resources
        yarnapp.submit(job, function=train)
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [(os.path.basename(f.filename), f.name) for f in frames] == [
        ("test_shipping.py", "test_the_apis_own_errors_leave_a_notebook_their_line_not_yarnapps_frames"),
        ("api.py", "call")], frames
    assert caught.traceback[-1].frame.f_locals.get("__tracebackhide__") is True
    with pytest.raises(YarnappError, match=r"app_nothing"):
        yarnapp.Run("app_nothing").status()
    assert not os.path.isdir(os.path.join(yarnapp_home, "apps")) or os.listdir(os.path.join(yarnapp_home, "apps")) == []


def test_progress_of_own_code_without_a_total_says_its_lines_beside_its_bar():
    """Own code's records have no total_steps: its tqdm bar has no total, whose bool() raises
    (tqdm's __bool__), and Progress.say asked `if self.bar:` - so a notebook's
    wait(progress=True) on a notebook function raised TypeError at its first restart or at its
    end, in place of the line saying how it ended."""
    import io

    from yarnapp.progress import Progress

    class Run:
        app_id = "app_x"

        def failure_message(self):
            return "app_x FAILED: rank 1 (w_1) exited with status 1"
    out = io.StringIO()
    shown = Progress(Run(), file=out)
    shown.tty = True                        # as in a notebook or a terminal: a bar
    shown.update({"state": "RUNNING", "progress": {0: {"step": 3, "loss": 0.5, "time": 1.0}},
                  "restarts": [{"generation": 1, "reason": "rank 1 (w_1) exited with status 1"}]})
    assert shown.bar is not None and shown.bar.total is None
    shown.end({"state": "FAILED"})
    shown.close()
    text = out.getvalue()
    assert "restart 1: rank 1 (w_1) exited with status 1" in text and "3it" in text, text
    assert "app_x FAILED: rank 1 (w_1) exited with status 1\n" in text, text     # written above the bar


def test_progress_counts_ranks_not_the_tensorboard_service_and_says_no_wait_once_formed():
    """On YARN `--wait` read "world formed ... (4 ranks)" for 3 ranks (the TensorBoard service
    is a container too), and, a failed application's second master attempt being ACCEPTED,
    YARN's "Application is Activated, waiting for resources" after the world had formed."""
    import io

    from yarnapp.progress import Progress

    class Run:
        app_id = "application_1_0001"
    out = io.StringIO()
    shown = Progress(Run(), file=out)
    containers = [{"id": f"w_{i}", "group": "w"} for i in range(3)] + [{"id": "tensorboard_0", "group": "tensorboard"}]
    shown.update({"state": "NEW", "diagnostics": "waiting for AM container to Register", "containers": []})
    shown.update({"state": "RUNNING", "world_formed_s": 10.2, "containers": containers})
    shown.update({"state": "NEW", "diagnostics": "Application is Activated, waiting for resources",
                  "world_formed_s": 10.2, "containers": containers})
    text = out.getvalue()
    assert "application_1_0001: waiting for AM container to Register" in text, text
    assert "world formed 10.20s after submit (3 ranks)" in text, text
    assert "Application is Activated" not in text, text


def test_rank_0s_own_output_is_shown_as_it_comes_without_yarnapps_lines(tmp_path):
    """What rank 0's code printed was in its container's log only (`submit --wait` showed a
    torchrun script nothing until its end): its lines now show as they come, yarnapp's own
    lines and a crash dump's module list left out, a line still being written left for the
    next look, and a line longer than a read shown in pieces rather than never."""
    import io

    from yarnapp.progress import OUTPUT_CHUNK, Progress

    class Run:
        app_id = "app_x"
    log = tmp_path / "container.log"
    log.write_text("==== w_0 attempt 1 started Sun Nov 29 (resources: ...) ====\n"
                   "2026-11-29 07:46:23,507 agent w_0 INFO: START -> RENDEZVOUS (generation 0)\n"
                   "2026-11-29 07:46:23,880 rank0 w_0 launcher.rank: world generation 0 formed\n"
                   "epoch 0 loss 2.3\n"
                   "==== Epoch 1/3 ====\n"                                   # the code's, not a header of ours
                   "fit:  10%|#    \rfit: 100%|#####\n"                       # a bar redrawn in place
                   "2026-11-29 07:46:24,000 rank0 w_0 mine: the user's own logger\n"
                   "Extension modules: numpy, torch._C\n"
                   "epoch 1 lo")
    st = {"state": "RUNNING", "containers": [{"id": "w_0", "rank": 0, "log": str(log)},
                                             {"id": "w_1", "rank": 1, "log": str(tmp_path / "other.log")}]}
    out = io.StringIO()
    shown = Progress(Run(), file=out)
    shown.update(st)
    with open(log, "a") as f:
        f.write("ss 1.9\n" + "x" * (OUTPUT_CHUNK + 10) + "\nafter\n")
    for _ in range(3):
        shown.update(st)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("w_0| ")]
    assert lines[:5] == ["w_0| epoch 0 loss 2.3", "w_0| ==== Epoch 1/3 ====", "w_0| fit: 100%|#####",
                         "w_0| 2026-11-29 07:46:24,000 rank0 w_0 mine: the user's own logger",
                         "w_0| epoch 1 loss 1.9"], lines
    assert "".join(line[5:] for line in lines[5:-1]) == "x" * (OUTPUT_CHUNK + 10) and lines[-1] == "w_0| after"
    # at the end: everything, however much (it showed a chunk more and lost the rest), and the
    # last line the code left without its newline, without the agent's record written after it
    with open(log, "a") as f:
        f.write("".join(f"line {i}\n" for i in range(20000)) + "no newline at exit"
                "2026-11-29 07:46:30,000 agent w_0 INFO: RUNNING -> SUCCEEDED (generation 0)\n")
    shown.update(dict(st, state="SUCCEEDED"))
    lines = [line for line in out.getvalue().splitlines() if line.startswith("w_0| ")]
    assert lines[-20001:] == [f"w_0| line {i}" for i in range(20000)] + ["w_0| no newline at exit"], lines[-3:]
