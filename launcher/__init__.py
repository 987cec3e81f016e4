"""Container side: the agent that runs a rank, the world it joins, and what it reports.

Imported first in every container (`python -m launcher.agent`) and by `import yarnapp`:
it makes `conf` yarnapp's own where a plain directory named conf (a folder of YAML files,
as Hydra keeps them) sits in the current or working directory, first on sys.path. An
editable install (`pip install -e .`, README's) finds yarnapp's packages through an
import hook that runs after sys.path, so that directory became a namespace package
`conf` without yarnapp's names, and `import yarnapp` failed with a bare ImportError. A
conf.py or conf/__init__.py of one's own is a module, and yarnapp refuses it in one line.
"""


def _own_conf():
    import importlib.util
    import os
    import sys
    if "conf" in sys.modules:
        return
    spec = importlib.util.find_spec("conf")
    init = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "__init__.py")
    if spec is None or spec.origin is not None or not os.path.isfile(init):
        return                      # found as a module (ours, or one the caller names), or not at all
    ours = importlib.util.spec_from_file_location("conf", init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(ours)
    sys.modules["conf"] = module
    try:
        ours.loader.exec_module(module)
    except BaseException:
        del sys.modules["conf"]
        raise


_own_conf()
