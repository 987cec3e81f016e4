"""Every strategy is one unit: its name is in the registry (training.strategies), the
schema's tagged union (conf.schema), the defaults (conf/defaults.yaml `strategies:`), the
job reference (docs/job-reference.md), the README's strategy list and the planner's
table, and nowhere only some of them."""
import json
import os
import re

import pytest

import conf
from training import planner, strategies

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def _places():
    doc = _read("docs", "job-reference.md")
    section = doc[doc.index("## Strategies"):doc.index("## Checkpoints")]
    readme = _read("README.md")
    bullet = next(par for par in readme.split("\n- ") if par.startswith("Training strategies:"))
    fixture = next(c for c in json.loads(_read("tests", "data", "planner_regression.json"))["jobs"]
                   if c["name"] == "one-rank-mlp")       # a plan from fixed measurements, quick to make
    plan = planner.plan_from(conf.load_job(fixture["job"]), planner.Measured.from_dict(fixture["measured"]),
                             planner.PlanOptions(bandwidths_bps=(1e9,), machines=(1,)))
    table = planner.format_table(plan).splitlines()
    return {
        "registry (training.strategies)": strategies.names(),
        "schema's union (conf.schema)": conf.strategy_names(),
        "conf/defaults.yaml strategies:": list(conf.defaults()["strategies"]),
        "docs/job-reference.md strategy table": re.findall(r"^\| `([a-z_]+)` \|", section, re.M),
        "README.md strategy list": re.findall(r"`([a-z_]+)`", bullet.split("`yarnapp plan")[0]),
        "the planner's table": [line.split()[0] for line in table
                                if line.split() and line.split()[0] in set(strategies.names()) | set(
                                    conf.strategy_names())],
    }


def test_every_strategy_name_is_in_every_place():
    places = _places()
    every = set().union(*map(set, places.values()))
    missing = {where: sorted(every - set(names)) for where, names in places.items() if every - set(names)}
    assert not missing, f"strategy names missing from some places: {missing}"


def test_the_registry_lists_each_strategy_once_with_its_parts():
    names = strategies.names()
    assert len(names) == len(set(names))
    for name in names:
        cls = strategies.get(name)
        assert cls.name == name, (name, cls)
        assert strategies.entry(name).title
        cost = strategies.cost_model(name)
        assert cost is None or callable(cost)
        assert conf.strategy_config(name).name == name


def test_the_reference_documents_exactly_each_strategys_own_fields():
    doc = _read("docs", "job-reference.md")
    documented = {}
    for name, field in re.findall(r"^\| `training\.strategy\[([a-z_]+)\]\.([a-z_]+)` \|", doc, re.M):
        documented.setdefault(name, []).append(field)
    for name in conf.strategy_names():
        assert sorted(documented.get(name, [])) == sorted(conf.strategy_fields(name)), name
        assert sorted(conf.defaults()["strategies"][name] or {}) == sorted(conf.strategy_fields(name)), name
