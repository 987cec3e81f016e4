"""docs/job-reference.md documents exactly the fields of the job schema, with the defaults
of conf/defaults.yaml: a field added, renamed or removed without the doc fails here."""
import os
import re
import typing

import pytest
import yaml
from pydantic import BaseModel

import conf
from conf.schema import JobSpec

pytestmark = pytest.mark.unit

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "job-reference.md")
CELL = re.compile(r"(?<!\\)\|")             # a table cell border (`\|` is a pipe inside a cell)


def _models(annotation):
    """The pydantic models inside an annotation (Optional[M], List[M], Annotated[...], unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _is_list(annotation):
    if typing.get_origin(annotation) is list:
        return True
    return any(_is_list(a) for a in typing.get_args(annotation) if typing.get_origin(annotation) is not dict)


def _tag(model):
    """The `name` of a member of a tagged union (the strategies), else None."""
    field = model.model_fields.get("name")
    args = typing.get_args(field.annotation) if field else ()
    return args[0] if field and typing.get_origin(field.annotation) is typing.Literal else None


def schema_fields(model=JobSpec, prefix=""):
    """{dotted path: annotation} of every field, recursively; list items are `name[].field`,
    the fields of a tagged union's member `name[tag].field` (its tag `name` is not a field)."""
    out = {}
    for name, field in model.model_fields.items():
        path = prefix + name
        if name == "name" and _tag(model) is not None:
            continue
        out[path] = field.annotation
        for sub in _models(field.annotation):
            tag = _tag(sub)
            sep = f"[{tag}]." if tag else "[]." if _is_list(field.annotation) else "."
            out.update(schema_fields(sub, path + sep))
    return out


def documented():
    """{dotted path: default cell} of every table row of the reference."""
    rows = {}
    with open(DOC) as f:
        for line in f:
            cells = [c.strip() for c in CELL.split(line.strip())[1:-1]]
            if len(cells) == 4 and re.fullmatch(r"`[^`]+`", cells[0]):
                path = cells[0].strip("`")
                assert path not in rows, f"{path} is documented twice"
                rows[path] = cells[2]
    return rows


def defaults():
    """{dotted path: default value} as conf/defaults.yaml gives them (templates in place)."""
    d = conf.defaults()
    group, training, strategies = d.pop("group"), d.pop("training"), d.pop("strategies")
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v
    walk(d, "")
    walk(group, "groups[].")
    walk(training, "training.")
    for name, fields in strategies.items():
        walk(fields or {}, f"training.strategy[{name}].")
    return out


def _cell(value):
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return f"`{text.removesuffix('...').strip()}`"


def test_schema_walk_sees_nested_and_list_fields():
    fields = schema_fields()
    for path in ("name", "groups", "groups[].vcores", "training", "training.data.train", "training.strategy",
                 "training.strategy[allreduce].bucket_mb", "training.strategy[conv_model_parallel].split",
                 "training.strategy[hypergraph].capacities", "tensorboard.service"):
        assert path in fields, path


def test_every_schema_field_is_documented():
    missing = sorted(set(schema_fields()) - set(documented()))
    assert not missing, f"fields missing from docs/job-reference.md: {missing}"


def test_the_reference_names_no_field_that_does_not_exist():
    unknown = sorted(set(documented()) - set(schema_fields()))
    assert not unknown, f"docs/job-reference.md documents fields the schema does not have: {unknown}"


def test_documented_defaults_are_the_defaults_file():
    fields, rows = schema_fields(), documented()
    wrong = {}
    for path, value in defaults().items():
        if path in rows and not _models(fields.get(path)):
            if rows[path] != _cell(value):
                wrong[path] = (rows[path], _cell(value))
    assert not wrong, f"documented default != conf/defaults.yaml (doc, file): {wrong}"
    # Fields without a default in the file must say they are required (or be sections).
    for path, cell in rows.items():
        if path in fields and path not in defaults() and not _models(fields[path]):
            assert cell == "*required*", f"{path}: no default in conf/defaults.yaml; document it as *required*"


@pytest.mark.parametrize("example", sorted(os.listdir(conf.EXAMPLES_DIR)))
def test_example_jobs_use_only_documented_fields(example):
    rows = documented()
    with open(os.path.join(conf.EXAMPLES_DIR, example)) as f:
        raw = yaml.safe_load(f)

    def paths(node, prefix):
        for k, v in node.items():
            path = prefix + k
            yield path
            if path == "training.strategy" and isinstance(v, dict):     # a block: NAME's fields
                yield from (f"{path}[{v['name']}].{k}" for k in v if k != "name")
            elif isinstance(v, dict) and path not in ("training.model_options", "groups[].env"):
                yield from paths(v, path + ".")
            elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                for item in v:
                    yield from paths(item, path + "[].")
    undocumented = sorted(set(paths(raw, "")) - set(rows))
    assert not undocumented, f"{example} uses fields missing from the reference: {undocumented}"
