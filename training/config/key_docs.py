"""The key tables, read from the schema: those of docs/configuration.md and `python train.py --help`."""

import inspect
import re
import textwrap
from typing import Any

from training.config.minimind_args import minimind_table
from training.config.presets import group_presets
from training.config.schema import CONF_DIR, SchemaKey, compose_config, schema_keys, schema_sections
from minimind.config import MiniMindConfig

BEGIN = "<!-- keys: {section} (written by scripts/config_docs.py from the schema; do not edit) -->"
END = "<!-- end of keys -->"
BLOCK = re.compile(r"<!-- keys: (\w+) .*?-->\n.*?<!-- end of keys -->", re.DOTALL)
MINIMIND_BEGIN = "<!-- keys of MiniMind's arguments (written by scripts/config_docs.py; do not edit) -->"
MINIMIND_BLOCK = re.compile(re.escape(MINIMIND_BEGIN) + r"\n.*?<!-- end of keys -->", re.DOTALL)

HEADER = """\
Sluice trains MiniMind language models on one process or many, with data (DP), tensor (TP) and
pipeline (PP) parallelism. The whole run is one config: pick presets with group=option and set
any key with key=value. Unknown keys are refused; a bad value stops with one line before launch."""

EXAMPLES = """\
  python train.py experiment=demo                                  # a small model on the embedded corpus
  python train.py model=tiny parallel.tp=2 parallel.pp=2 schedule=zb-h1   # 4 local workers, zero-bubble
  python train.py -m model=tiny schedule=gpipe,1f1b parallel.pp=2,4       # a sweep: every job its own workers"""

FOOTER = """\
Print the composed config without running: python train.py [overrides] --cfg job
Every key with its meaning: docs/configuration.md. Hydra's own flags (sweeps, launchers): python train.py --hydra-help"""


def run_defaults(overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Each key's value in `python train.py [overrides]`; a model key left null shows MiniMind's default."""
    from omegaconf import OmegaConf

    cfg = compose_config(list(overrides))
    minimind = inspect.signature(MiniMindConfig.__init__).parameters
    values = {}
    for key in schema_keys():
        value = OmegaConf.select(cfg, key.name)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        leaf = key.name.partition(".")[2]
        if key.name.startswith("model.") and value is None and leaf in minimind:
            value = minimind[leaf].default
        values[key.name] = value
    return values


def shown_value(value: Any) -> str:
    """A default as YAML writes it: null, true, 5e-4, [0.9, 0.95]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value and (abs(value) < 1e-3 or abs(value) >= 1e5):
        mantissa, exponent = f"{value:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if isinstance(value, list):
        return f"[{', '.join(shown_value(v) for v in value)}]"
    return str(value)


def section_keys(section: str) -> list[SchemaKey]:
    return [k for k in schema_keys() if k.name.startswith(f"{section}.")]


def key_table(section: str, defaults: dict[str, Any]) -> str:
    """The markdown table of one section: key, default, meaning."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k.name}` | `{shown_value(defaults[k.name])}` | {k.meaning} |" for k in section_keys(section)]
    return "\n".join(rows)


def write_tables(markdown: str, defaults: dict[str, Any]) -> str:
    """`markdown` with every generated key block replaced by the schema's current table, and the MiniMind
    arguments' block by their table."""
    def table(match: re.Match) -> str:
        section = match.group(1)
        return f"{BEGIN.format(section=section)}\n{key_table(section, defaults)}\n{END}"
    minimind = f"{MINIMIND_BEGIN}\n{minimind_table()}\n{END}"
    return MINIMIND_BLOCK.sub(lambda _: minimind, BLOCK.sub(table, markdown))


def plain(meaning: str) -> str:
    """A meaning without markdown: code marks and link targets dropped."""
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", meaning).replace("`", "")


def help_text(overrides: tuple[str, ...] = ()) -> str:
    """`python train.py [overrides] --help`: what Sluice is, the presets, every key with its value under those
    overrides and its meaning, examples."""
    defaults = run_defaults(overrides)
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    lines = [HEADER, "", "== Presets (group=option) =="]
    lines += [f"  {g.name}: {', '.join(group_presets(g.name))}" for g in groups]
    for section in schema_sections():
        lines += ["", f"== {section} =="]
        for k in section_keys(section):
            lines.append(f"  {k.name} = {shown_value(defaults[k.name])}")
            lines.append(textwrap.fill(plain(k.meaning), 110, initial_indent=" " * 6, subsequent_indent=" " * 6))
    lines += ["", "== Examples ==", EXAMPLES, "", FOOTER]
    return "\n".join(lines)
