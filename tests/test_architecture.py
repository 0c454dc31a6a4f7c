"""The shape of the code: dependencies point down only, no import circle, no oversized file or function."""

import ast
import re
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
