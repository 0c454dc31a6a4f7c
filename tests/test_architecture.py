"""The shape of the code: dependencies point down only, no import circle, no oversized file or function."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["minimind", "parallel", "models", "checkpoint", "training"]  # bottom to top; train.py, scripts/ above
MODEL_NAMES = ("embed_tokens", "lm_head", "layers", "Attention", "FeedForward")  # what parallel/ must never name


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every package module of the project."""
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in the file (lazy imports included), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, name, known) for name, path in known.items()}


def test_dependencies_point_down_only():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = [(a, b) for a, deps in graph().items() for b in deps
              if rank[b.split(".")[0]] > rank[a.split(".")[0]]]
    assert not upward, upward


def test_no_import_circle_between_files():
    deps = graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(deps.get(node, ())):
            if nxt.rpartition(".")[0] == node or node.rpartition(".")[0] == nxt:
                continue  # a package and its own modules
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(deps):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, " -> ".join(cycle)


def test_omegaconf_stays_out_of_the_model_and_parallel_layers():
    offenders = [str(p.relative_to(ROOT)) for layer in ("minimind", "parallel") for p in (ROOT / layer).rglob("*.py")
                 if "omegaconf" in p.read_text()]
    assert not offenders, offenders


def test_no_file_over_400_lines_and_no_long_function_in_parallel():
    sources = [p for p in ROOT.rglob("*.py") if not {".venv", "tests", ".git"} & set(p.relative_to(ROOT).parts)]
    long_files = [f"{p.relative_to(ROOT)} ({n})" for p in sources if (n := len(p.read_text().splitlines())) > 400]
    assert not long_files, long_files
    long_functions = []
    for path in (ROOT / "parallel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 50:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long_functions, long_functions


def test_no_script_or_package_shadows_a_standard_library_module():
    """`python scripts/x.py` puts scripts/ first on sys.path: a scripts/profile.py would replace the stdlib's."""
    import sys

    names = {p.stem for p in (ROOT / "scripts").rglob("*.py")} | {p.stem for p in ROOT.glob("*.py")} | set(LAYERS)
    assert not names & sys.stdlib_module_names, sorted(names & sys.stdlib_module_names)


def model_namings(path: Path) -> list[str]:
    """Where a file imports minimind, or names a model's piece: an identifier or attribute equal to one of
    MODEL_NAMES, or a string (docstrings aside) holding one as a whole dotted component."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "minimind" for a in node.names):
            found.append(f"{where} imports minimind")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minimind":
            found.append(f"{where} imports minimind")
        elif isinstance(node, ast.Attribute) and node.attr in MODEL_NAMES:
            found.append(f"{where} attribute .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in MODEL_NAMES:
            found.append(f"{where} name {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if set(node.value.split(".")) & set(MODEL_NAMES):
                found.append(f"{where} string {node.value!r}")
    return found


def test_parallel_imports_no_model_and_names_none_of_its_pieces():
    """parallel/ knows a model only through its declared plans and adapter (parallel/decoder.py)."""
    offenders = [hit for path in sorted((ROOT / "parallel").rglob("*.py")) for hit in model_namings(path)]
    assert not offenders, offenders


def test_the_naming_check_catches_each_kind(tmp_path):
    """The check above fails on an import, an attribute, a name and a key string (so it cannot pass vacuously)."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Docstrings may say lm_head."""\nimport minimind\nx = m.model.embed_tokens\ny = Attention\n'
                      'z = "lm_head.weight"\n')
    kinds = [hit.split(" ", 1)[1].split(" ")[0] for hit in model_namings(sample)]
    assert sorted(kinds) == ["attribute", "imports", "name", "string"], kinds


# An objective's words: parallel/ knows a generic Objective and MicroBatch.extra, never which objective runs.
OBJECTIVE_WORDS = re.compile(r"\b(dpo|preference|\w*logps|reward|reference (pass|model|log)|language ?model ?loss|"
                             r"LANGUAGE_MODEL|shifted_loss_sum)", re.IGNORECASE)


def namings(path: Path, words: re.Pattern) -> list[str]:
    """Every line of the file (code, strings, comments and docstrings alike) that `words` finds."""
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1) if words.search(line)]


def parallel_namings(words: re.Pattern) -> list[str]:
    """The lines of parallel/ that `words` finds."""
    return [hit for path in sorted((ROOT / "parallel").rglob("*.py")) for hit in namings(path, words)]


def flagged_lines(tmp_path: Path, lines: list[str], words: re.Pattern) -> list[int]:
    """The line numbers `words` finds in a file of `lines`."""
    sample = tmp_path / "sample.py"
    sample.write_text("\n".join(lines) + "\n")
    return [int(hit.split(":")[1]) for hit in namings(sample, words)]


def test_parallel_names_no_objective():
    """The LM loss, DPO and the reference pass live in training/objectives/ and reach the last stage as an Objective
    with the micro-batch's payload; no module of parallel/ names one of them."""
    offenders = parallel_namings(OBJECTIVE_WORDS)
    assert not offenders, offenders


def test_the_objective_check_catches_each_name(tmp_path):
    """The check above fails on each way an objective used to be named in parallel/ (so it cannot pass vacuously)."""
    lines = ["from parallel.preference import RowLogps", "mb.ref_logps", "def sequence_logps(): ...",
             "# DPO's sums", '"""the reference log-probabilities"""', "LANGUAGE_MODEL = LanguageModelLoss()",
             "shifted_loss_sum(logits, labels)", "reward_margin", "reference counting frees it"]
    assert flagged_lines(tmp_path, lines, OBJECTIVE_WORDS) == list(range(1, len(lines)))


# A fine-tuning method's words: parallel/ runs the passes its caller lists (EngineSpec.passes), never names one.
FINE_TUNING_WORDS = re.compile(r"(lora|peft|low[- ]rank|fine[- ]?tun|adapter_pairs|merge_adapters)", re.IGNORECASE)


def test_parallel_names_no_fine_tuning_method():
    """LoRA is a chunk pass of training/methods/lora.py that the trainer hands the engine, its merge is checkpoint's; the
    TP layers offer a generic additive branch. No module of parallel/ names LoRA or any other fine-tuning method."""
    offenders = parallel_namings(FINE_TUNING_WORDS)
    assert not offenders, offenders


def test_the_fine_tuning_check_catches_each_name(tmp_path):
    """The check above fails on each way LoRA used to be named in parallel/ (so it cannot pass vacuously)."""
    lines = ["from parallel.lora import apply_lora", "from parallel.spec import LoraSpec", "    lora: LoraSpec",
             "# a frozen weight (LoRA's base)", '"""with_adapters for PEFT names"""', "a low-rank branch",
             "fine-tuning", "merge_adapters(state, scale)", "the family adapter's tp_module"]
    assert flagged_lines(tmp_path, lines, FINE_TUNING_WORDS) == list(range(1, len(lines)))



def runtime_imports(path: Path, name: str, known: dict[str, Path], scratch: Path) -> set[str]:
    """The project modules a file imports at run time: those of `imports_of` less the annotation-only ones under
    `if TYPE_CHECKING:` (the stripped source is written to `scratch` for `imports_of` to read)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = [ast.Pass()]
    stripped = scratch / path.name  # the same file name: `imports_of` tells a package by it
    stripped.write_text(ast.unparse(tree))
    return imports_of(stripped, name, known)


MAX_RUNTIME_IMPORTS = 10  # issue 36: engine.py imported 23 project modules and its constructor did seven jobs


def test_no_module_of_parallel_imports_more_than_ten_project_modules_at_run_time(tmp_path):
    known = modules()
    counts = {name: len(runtime_imports(path, name, known, tmp_path)) for name, path in known.items()
              if name.split(".")[0] == "parallel"}
    over = {name: n for name, n in counts.items() if n > MAX_RUNTIME_IMPORTS}
    assert not over, over


# --- training/ inside: its parts in layers, its imports at the top. ---------------------------------------------------
# training/'s parts, bottom to top (issue 47 item 5): a module imports only from its own layer or below, lazy imports
# included. A module takes the layer of the longest name listed that it equals or lies under. The order is the one the
# code has: the value rules and the reliability machinery need nothing else of training/; data is read by the
# objectives (DPO's reference pass fills pair batches), both by the methods; the config's schema gathers the methods'
# sections and the specs are made from it; the report and the layout search read config and specs; the pre-launch
# check asks every part below it (a layout is checked as the search checks its candidates); the loop runs what those
# build, and launch starts it all.
TRAINING_LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["training.rules", "training.reliability"]),
    ("data", ["training.data"]),
    ("objectives", ["training.objectives"]),
    ("methods", ["training.methods"]),
    ("config", ["training.config", "training.specs"]),
    ("report", ["training.report"]),
    ("search", ["training.layout_search"]),
    ("checks", ["training.config.validate"]),
    ("loop", ["training.trainer", "training.optim"]),
    ("launch", ["training.launch", "training"]),
]


def training_layer(module: str) -> int:
    """The index in TRAINING_LAYERS of a training/ module's layer (its longest listed prefix)."""
    found = [(len(prefix), i) for i, (_, prefixes) in enumerate(TRAINING_LAYERS) for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".")]
    return max(found)[1]


def upward_imports(deps: dict[str, set[str]]) -> list[str]:
    """Every import of a training/ module that points to a higher layer of training/, as 'a (layer) -> b (layer)'."""
    name = [layer for layer, _ in TRAINING_LAYERS]
    return [f"{a} ({name[training_layer(a)]}) -> {b} ({name[training_layer(b)]})"
            for a, found in sorted(deps.items()) if a.split(".")[0] == "training"
            for b in sorted(found) if b.split(".")[0] == "training" and training_layer(b) > training_layer(a)]


def test_training_imports_point_down_its_layers_only():
    offenders = upward_imports(graph())
    assert not offenders, offenders


def test_the_layer_check_catches_an_upward_import():
    """The check above fails on a data module importing the schema, lazily or not (so it cannot pass vacuously)."""
    deps = {"training.data.spec": {"training.config.schema", "training.data.rows"},
            "training.launch.cli": {"training.config.validate"}}
    assert upward_imports(deps) == ["training.data.spec (data) -> training.config.schema (config)"]


PROJECT = set(LAYERS) | {"tests"}


def lazy_imports(path: Path) -> list[str]:
    """The project imports inside a function of the file whose lines carry no comment saying why."""
    lines = path.read_text().splitlines()
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] in PROJECT for n in names) and \
                    not any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_training_imports_sit_at_the_top_unless_a_comment_says_why():
    """A project import inside a function hides a dependency from the reader of the file's top; one there to break
    an import cycle or to defer a heavy import on purpose says so on its line."""
    offenders = [hit for path in sorted((ROOT / "training").rglob("*.py")) for hit in lazy_imports(path)]
    assert not offenders, offenders


def test_the_lazy_import_check_catches_an_import_without_a_reason(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from training.data import rows\n\n\ndef f():\n    from training.specs import lora_spec\n"
                      "    from parallel.grid import resolve_backend  # torch.distributed: only on a launch\n"
                      "    import json\n")
    assert [hit.split(":")[1] for hit in lazy_imports(sample)] == ["5"]


# --- One meaning per name (docs/concepts.md#names): the names retired from a second meaning. ----------------------
RETIRED_NAMES = re.compile(
    r"parallel\.plan\b|\bplan=auto|scripts/plan\.py|make plan\b|\bplan\.png|\bPLAN\b|load_plan_module|tests/test_plan\b"
    r"|chunked_ce|CHUNK_ELEMENTS|ChunkedCrossEntropy|DRAIN_CHUNK|\bchunk_of\b|later chunk|list\[Record\]"
    r"|key reference")
# Where a retired name is said on purpose: the refusal of the old key, its test, and this list.
RETIRED_NAMES_SAID = {"training/config/run_model.py", "tests/test_config_catalogue.py", "tests/test_architecture.py"}


def retired_name_uses(paths: list[Path]) -> list[str]:
    """The lines of `paths` (code, config, docs) that use a retired name."""
    return [hit for path in paths for hit in namings(path, RETIRED_NAMES)]


def test_no_retired_name_in_the_code_or_the_docs():
    """"plan" is only a model's declared plans (the layout key is parallel.layout, the preview script
    scripts/preview.py), "chunk" only a stage's model piece (a virtual-stage index is a lap, the cross-entropy's row
    blocks are blocks), a trace's (action, start, end) is Timed, not a record; the key tables are no "reference"."""
    tracked = [ROOT / name for name in subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()]
    paths = [p for p in tracked if p.suffix in {".py", ".md", ".yaml", ".sh", ".sbatch"} or p.name == "Makefile"]
    offenders = retired_name_uses([p for p in paths if p.is_file()
                                   and str(p.relative_to(ROOT)) not in RETIRED_NAMES_SAID])
    assert not offenders, offenders


def test_the_retired_name_check_catches_each_name(tmp_path):
    lines = ["python train.py parallel.plan=auto", "python scripts/plan.py model=tiny", "make plan ARGS=...",
             "from parallel.chunked_ce import cross_entropy_rows", "chunk_of = _chunks(row)", "PLAN = (True, False)",
             "records: list[Record] | None", "the key reference of --help", "the plan of a model"]
    assert flagged_lines(tmp_path, lines, RETIRED_NAMES) == list(range(1, len(lines)))
