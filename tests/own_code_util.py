"""What the own-code tests share: their jobs' directory, groups, and a job of a script."""
import os

from util import write_job

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
GROUPS = [{"name": "big", "instances": 1, "vcores": 1, "memory": "2 GiB"},
          {"name": "small", "instances": 2, "vcores": 0.5, "memory": "2 GiB"}]


def script_job(tmp_path, name, source, groups=GROUPS, max_restarts=0, files=None, **extra):
    """job.yaml of `run.script: code/<name>.py` holding `source` ({name: text} of other files beside it)."""
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    for fname, text in (files or {}).items():
        (code / fname).write_text(text)
    (code / f"{name}.py").write_text(source)
    return write_job(tmp_path / f"{name}.yaml", {"name": name, "groups": groups, "max_restarts": max_restarts,
                                                 "run": {"script": str(code / f"{name}.py")}, **extra})
