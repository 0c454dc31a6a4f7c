"""docs/recipe.md's figures, read from the runs its commands wrote: check them against the page, or rewrite the page.

Usage: python scripts/recipe_figures.py [RUN_ROOT] [--write]
RUN_ROOT (default `runs/recipe`) holds the run directories the page's commands made. Each figure on the page sits
between markers, `<!--KEY-->4.71<!---->`, where KEY is `<run>:<metric>@<when>` (a `metrics.jsonl` field of
RUN_ROOT/<run> at step N, `last`, or the mean of the first or last quarter of the logged rows, `q1` / `q4`), or
`answer` (what the page's generate.py command prints, run here). A number is compared at the decimals the page prints
it with. Without `--write` the differences are listed (exit 1 if any); with it the page takes the measured values.
tests/test_recipe.py runs the page's commands and fails on any difference, naming this command to regenerate the page.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "recipe.md"
RUN_ROOT = "runs/recipe"
MARKER = re.compile(r"<!--(?P<key>[\w.:@-]+)-->(?P<value>.*?)<!---->")
KEY = re.compile(r"(?P<run>[\w-]+):(?P<metric>\w+)@(?P<when>\d+|last|q1|q4)")


def page_commands(page: Path = PAGE) -> list[list[str]]:
    """The argv of every command in the page's bash blocks, in page order (comments dropped)."""
    commands, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside and line.strip():
            commands.append(shlex.split(line.split("  #")[0]))
    return commands


def rows(root: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines()]


def metric(root: Path, key: str) -> float:
    """One `<run>:<metric>@<when>` figure from RUN_ROOT's metrics.jsonl files."""
    parts = KEY.fullmatch(key)
    if parts is None:
        raise ValueError(f"figure key {key!r} is not <run>:<metric>@<step|last|q1|q4>")
    logged = [row for row in rows(root, parts["run"]) if parts["metric"] in row]
    when = parts["when"]
    if when in ("q1", "q4"):
        quarter = logged[:len(logged) // 4] if when == "q1" else logged[-(len(logged) // 4):]
        return sum(row[parts["metric"]] for row in quarter) / len(quarter)
    found = logged[-1:] if when == "last" else [row for row in logged if row["step"] == int(when)]
    if not found:
        raise ValueError(f"figure {key}: no logged {parts['metric']} at step {when} in {parts['run']}/metrics.jsonl")
    return found[0][parts["metric"]]


def shown(value: float | str, like: str) -> str:
    """`value` as the page prints `like`: a number at its decimals, an answer in its backticks."""
    if isinstance(value, str):
        return f"`{value}`" if like.startswith("`") else value
    decimals = len(like.partition(".")[2])
    return f"{value:.{decimals}f}"


def generated(root: Path, page: Path = PAGE) -> str:
    """What the page's generate.py command prints, run here against RUN_ROOT."""
    words = next(w for w in page_commands(page) if w[1].endswith("generate.py"))
    spec = importlib.util.spec_from_file_location("recipe_generate", ROOT / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = module.main([word.replace(RUN_ROOT, str(root)) for word in words[2:]])
    if code != 0:
        raise RuntimeError(f"generate.py {' '.join(words[2:])} exited {code}")
    return out.getvalue().strip()


def measured(text: str, root: Path, answer: str) -> dict[str, str]:
    """Every marked figure of the page text, as the runs under `root` give it, printed as the page prints it."""
    return {m["key"]: shown(answer if m["key"] == "answer" else metric(root, m["key"]), m["value"])
            for m in MARKER.finditer(text)}


def differences(text: str, figures: dict[str, str]) -> list[str]:
    """`key: page X, measured Y` for each marked figure the runs print otherwise."""
    return [f"{m['key']}: page {m['value']}, measured {figures[m['key']]}"
            for m in MARKER.finditer(text) if figures[m["key"]] != m["value"]]


def rewritten(text: str, figures: dict[str, str]) -> str:
    """The page text with every marked figure replaced by the measured one."""
    return MARKER.sub(lambda m: f"<!--{m['key']}-->{figures[m['key']]}<!---->", text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_root", nargs="?", default=RUN_ROOT)
    parser.add_argument("--write", action="store_true", help="rewrite docs/recipe.md with the measured figures")
    args = parser.parse_args(argv)
    root, text = Path(args.run_root), PAGE.read_text()
    try:
        figures = measured(text, root, generated(root))
    except (OSError, ValueError, RuntimeError) as error:
        print(f"recipe_figures: {error} (run the page's commands with runs/recipe under {root} first)",
              file=sys.stderr)
        return 2
    if args.write:
        PAGE.write_text(rewritten(text, figures))
        print(f"docs/recipe.md: {len(figures)} figures from {root}")
        return 0
    wrong = differences(text, figures)
    print("\n".join(wrong) or f"docs/recipe.md: all {len(figures)} figures agree with {root}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
