"""The schema is the one home of a key: validation, `--help` and the docs table read it, and no default is restated."""

import ast
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from minimind.config import MiniMindConfig
from tests.conftest import ROOT
from training.config.key_docs import key_table, run_defaults, write_tables
from training.config.run_model import section_model
from training.config.schema import CONF_DIR, schema_keys, schema_sections

DOC = ROOT / "docs" / "configuration.md"
CODE = ["training", "parallel", "checkpoint", "models", "minimind", "scripts", "train.py"]
NEUTRAL = (None, True, False, 0, 1, "")  # "off", "none", "one": a parameter's natural default, not a knob's

THROWAWAY = '    throwaway_knob: int = key(7, "a knob this test adds", positive)\n'
# Run inside the copy: the three readers of the schema, each asked about the new key.
PROBE = r"""
import contextlib, io, json, runpy
from training.launch.cli import preflight
from training.config.key_docs import help_text
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        preflight(["model=tiny", "train.throwaway_knob=0"])
        code = 0
    except SystemExit as exit:
        code = exit.code
    config_docs = runpy.run_path("scripts/config_docs.py")["main"]  # the script, as `python scripts/...` runs it
    stale = config_docs(["--check"])
    config_docs([])
print(json.dumps({"code": code, "error": err.getvalue(), "help": help_text(), "stale": stale,
                  "docs": open("docs/configuration.md").read()}))
"""


def test_a_key_added_to_the_schema_alone_reaches_validation_help_and_docs(tmp_path):
    copy = tmp_path / "sluice"
    for name in [*CODE, "conf", "docs"]:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, copy / name)
    schema = copy / "training" / "config" / "schema.py"
    text = schema.read_text()
    anchor = "\n\n@dataclass\nclass OptimSchema"
    assert anchor in text
    schema.write_text(text.replace(anchor, "\n" + THROWAWAY.rstrip("\n") + anchor, 1))

    result = subprocess.run([sys.executable, "-c", PROBE], cwd=copy, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["code"] == 2
    assert "train.throwaway_knob=0 must be positive" in seen["error"]
    assert "train.throwaway_knob = 7" in seen["help"] and "a knob this test adds" in seen["help"]
    assert seen["stale"] == 1  # the committed table no longer matches the schema, and the check says so
    assert "| `train.throwaway_knob` | `7` | a knob this test adds |" in seen["docs"]


def test_the_committed_docs_tables_are_the_schemas():
    text = DOC.read_text()
    assert write_tables(text, run_defaults()) == text, "run python scripts/config_docs.py"
    assert key_table("train", run_defaults()).count("\n| `train.") == len([k for k in schema_keys()
                                                                          if k.name.startswith("train.")])


def test_every_key_has_a_meaning_and_a_rule():
    for key in schema_keys():
        assert key.meaning.strip() and callable(key.rule), key.name


def test_the_run_model_is_the_schema_checked_by_pydantic():
    """One schema: the pydantic model has exactly its sections and keys, forbids others and raises each rule's line."""
    model = section_model()
    assert tuple(model.model_fields) == schema_sections()
    leaves = [f"{s}.{k}" for s, f in model.model_fields.items() for k in f.annotation.model_fields]
    assert leaves == [key.name for key in schema_keys()]
    with pytest.raises(ValidationError) as refused:
        model.model_validate({"train": {"steps": 0, "stepz": 1}, "zzz": {}})
    assert [(e["type"], e["loc"], e["msg"]) for e in refused.value.errors()] == [
        ("sluice_rule", ("train", "steps"), "train.steps=0 must be positive; set train.steps to a value > 0"),
        ("extra_forbidden", ("train", "stepz"), "Extra inputs are not permitted"),
        ("extra_forbidden", ("zzz",), "Extra inputs are not permitted")]


def schema_default(leaf: str, value: object) -> str | None:
    """The schema key named `leaf` whose default `value` restates (None when it restates none)."""
    for key in schema_keys():
        same = key.default == value and isinstance(value, bool) == isinstance(key.default, bool)
        if key.name.rpartition(".")[2] == leaf and same:
            return key.name
    return None


def restatements(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) where code states a schema default again: `.get(key, default)`, `getattr(x, key, default)`, a
    keyword default or a dataclass field default named like the key (neutral defaults such as 0, 1 and None aside)."""
    found = []

    def check(line: int, leaf: object, node: ast.AST | None, neutral_ok: bool) -> None:
        if not isinstance(leaf, str) or node is None:
            return
        try:
            value = ast.literal_eval(node)
        except ValueError:
            return
        if value is None or (neutral_ok and value in NEUTRAL):
            return
        if key := schema_default(leaf, value):
            found.append((line, key))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name == "get" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
                check(node.lineno, node.args[0].value, node.args[1], neutral_ok=False)
            if name == "getattr" and len(node.args) == 3 and isinstance(node.args[1], ast.Constant):
                check(node.lineno, node.args[1].value, node.args[2], neutral_ok=False)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
                check(node.lineno, arg.arg, default, neutral_ok=True)
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                check(node.lineno, arg.arg, default, neutral_ok=True)
        elif isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    check(statement.lineno, statement.target.id, statement.value, neutral_ok=True)
    return found


def test_no_code_restates_a_schema_default():
    schema = ROOT / "training" / "config" / "schema.py"
    found = []
    for name in CODE:
        paths = [ROOT / name] if name.endswith(".py") else sorted((ROOT / name).rglob("*.py"))
        for path in (p for p in paths if p != schema):
            found += [f"{path.relative_to(ROOT)}:{line}: {key}" for line, key in restatements(ast.parse(path.read_text()))]
    assert not found, "schema defaults restated (read the config, or take training.specs.default_engine_spec):\n" + \
        "\n".join(found)


def test_the_scan_finds_a_restated_default():
    tree = ast.parse("def f(cfg, timeout_s=300.0):\n    return cfg.get('bucket_mb', 25.0)\n")
    assert sorted(restatements(tree)) == [(1, "parallel.timeout_s"), (2, "parallel.bucket_mb")]


def preset_leaves(path: Path) -> dict[str, object]:
    """The keys a preset file sets, as `section.key` (a group file is its section; an experiment names sections)."""
    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    group = path.parent.name
    sections = data if group == "experiment" else {group: data}
    return {f"{section}.{leaf}": value for section, body in sections.items() for leaf, value in body.items()}


def test_no_preset_restates_a_default():
    defaults = {key.name: key.default for key in schema_keys()}
    minimind = inspect.signature(MiniMindConfig.__init__).parameters
    found = []
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        if "hydra" in path.parts or path.name == "config.yaml":
            continue
        leaves = preset_leaves(path)
        for name, value in leaves.items():
            leaf = name.partition(".")[2]
            if value == defaults.get(name) and value is not None:
                found.append(f"{path.relative_to(ROOT)}: {name}={value} is the schema default")
            elif name.startswith("model.") and "model.hf_config" not in leaves and leaf in minimind \
                    and value == minimind[leaf].default:
                found.append(f"{path.relative_to(ROOT)}: {name}={value} is MiniMindConfig's default")
    assert not found, "\n".join(found)


def test_the_preset_scan_reads_experiments(tmp_path):
    (tmp_path / "experiment").mkdir()
    path = tmp_path / "experiment" / "x.yaml"
    path.write_text("defaults:\n  - override /model: tiny\ntrain:\n  steps: 3\n")
    assert preset_leaves(path) == {"train.steps": 3}
