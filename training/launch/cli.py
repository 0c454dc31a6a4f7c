"""Command-line front door: compose and validate every job of the command line before Hydra runs any."""

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from training.config import CONF_DIR, ConfigError, register_schema
from training.config.validate import validate
from training.config.presets import group_presets
from training.config.schema import compose_config
from training.config.minimind_args import minimind_flag_problem
from training.config.run_length import length_problem
from training.config.run_model import override_key_problem
from training.config.output_paths import output_dir_problem

EXIT_CONFIG_ERROR = 2
# Flags after which Hydra takes one value; the value is not an override.
VALUE_FLAGS = {"-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "--cfg", "-c", "-p",
               "--package", "--experimental-rerun", "--shell-completion", "-sc"}
# Informational flags: Hydra answers them itself, nothing to validate.
INFO_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc"}
MULTIRUN_FLAGS = {"-m", "--multirun"}
HYDRA_FLAGS = VALUE_FLAGS | INFO_FLAGS | MULTIRUN_FLAGS | {"--run", "-r", "--resolve", "--version"}

def fail(message: str) -> None:
    """Print one line and leave with the config-error exit code."""
    print(f"sluice: config error: {message}", file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)


def compose_validated(overrides: list[str]) -> DictConfig:
    """The run config train.py would see, validated (for scripts); exit 2 with one line if it is wrong."""
    try:
        cfg = compose_config(overrides)
    except Exception as error:  # Hydra's composition errors: one line, as train.py prints them
        fail(explain_compose_error(error, overrides))
    try:
        validate(cfg)
    except ConfigError as error:
        fail(str(error))
    return cfg


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split argv into Hydra flags (with their values) and key=value overrides."""
    flags, overrides, expect_value = [], [], False
    for arg in argv:
        if expect_value:
            flags.append(arg)
            expect_value = False
        elif arg.startswith("-") and not arg.startswith("~"):
            flags.append(arg)
            expect_value = arg in VALUE_FLAGS
        else:
            overrides.append(arg)
    return flags, overrides


def expand_jobs(overrides: list[str]) -> Iterator[list[str]]:
    """The override lists of every job of a sweep (one list when nothing sweeps); Hydra's own groups dropped."""
    choices, keys = [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if override.key_or_group.startswith("hydra/"):  # launcher, sweeper, logging: Hydra's groups, not swept
            choices.append([override.input_line])  # kept, so the hydra.launcher.* keys they bring compose
            continue
        keys.append(override.key_or_group)
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    if problem := override_key_problem(keys, {p.name for p in CONF_DIR.iterdir() if p.is_dir()}):  # config groups
        raise ConfigError(problem)
    return (list(job) for job in itertools.product(*choices))


def explain_compose_error(error: Exception, job: list[str]) -> str:
    """Turn Hydra's multi-line composition error into one line that names the key and the fix."""
    text = str(error).strip()
    if error.__cause__ is not None:  # OmegaConf's reason (e.g. a type mismatch) hides in the cause
        text += "\n" + str(error.__cause__).strip()
    for override in job:
        key, _, value = override.lstrip("+~").partition("=")
        if (CONF_DIR / key).is_dir() and f"'{key}/{value}'" in text:
            presets = group_presets(key)
            return f"{key}={value}: no such preset; use one of {', '.join(presets)}"
    deleted = [o[1:].partition("=")[0] for o in job if o.startswith("~")]
    if deleted and ("delet" in text.lower()):  # Hydra's words differ for a set key and a null one
        return f"{deleted[0]}: deleting a key is not supported; set it instead ({deleted[0]}=null where null is " \
               "allowed, or drop the override)"
    key = getattr(error.__cause__, "full_key", None)
    if key:  # OmegaConf names the key it refused (a type mismatch, a deletion): say that first
        reason = str(error.__cause__).strip().splitlines()[0]
        return f"{key}: {reason} (`python train.py --cfg job` prints every key and value)"
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(
        ("full_key", "object_type", "reference_type", "Set the environment"))]
    detail = " ".join(lines[:2]) if lines else type(error).__name__
    return f"{detail} (check the override; `python train.py --cfg job` prints every key and value)"


def hydra_dir_problem(hydra_cfg: DictConfig, multirun: bool) -> str | None:
    """The run (or sweep) directory can be created and written, judged without creating anything."""
    key = "sweep.dir" if multirun else "run.dir"
    try:
        path = Path(str(OmegaConf.select(hydra_cfg, key, throw_on_resolution_failure=True)))
    except OmegaConfBaseException as error:
        return f"hydra.{key}: cannot resolve it ({str(error).splitlines()[0]})"
    return output_dir_problem(path, f"hydra.{key}")


def job_problems(job: list[str], world_size: int | None, multirun: bool, warnings: list[str]) -> Iterator[str | None]:
    """One job's pre-launch checks in order: its output directory and length (what only the command line knows),
    `validate` (which raises its own first problem; its warnings join `warnings`), then its memory needs."""
    try:
        cfg = compose_config(job, with_hydra=True)
    except Exception as error:  # Hydra's composition errors: one line, not its traceback
        yield explain_compose_error(error, job)
        return
    # A sweep's launcher other than Hydra's basic one (Slurm, submitit) runs the jobs on other hosts.
    elsewhere = multirun and not str(OmegaConf.select(cfg.hydra, "launcher._target_")).endswith(".BasicLauncher")
    with read_write(cfg), open_dict(cfg):
        yield hydra_dir_problem(cfg.hydra, multirun)
        cfg.pop("hydra")
    yield length_problem(job, cfg)  # train.steps and train.epochs: the one rule reading the command line
    warnings += validate(cfg, world_size)
    from training.launch.memory_fit import memory_problem  # the meta model and the cost model: after the cheap checks

    yield memory_problem(cfg, world_size, this_host=not elsewhere)


def preflight(argv: list[str]) -> None:
    """Compose and validate every job of this command line; exit 2 with one line on the first problem. Every job of a
    sweep is checked before Hydra starts the first one, so a bad value never runs half a sweep."""
    if problem := minimind_flag_problem(argv, HYDRA_FLAGS):  # `--epochs 2`: MiniMind's habit, not Hydra's grammar
        fail(problem)
    flags, overrides = split_argv(argv)
    if INFO_FLAGS & set(flags):
        return
    register_schema()
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    warnings: dict[str, None] = {}
    try:
        try:
            jobs = expand_jobs(overrides)
        except ConfigError:
            raise
        except Exception as error:  # Hydra's grammar errors: report the line, not the parser's traceback
            fail(f"cannot parse overrides {' '.join(overrides)}: {str(error).splitlines()[0]}")
        for job in jobs:
            found: list[str] = []
            for problem in job_problems(job, world_size, bool(MULTIRUN_FLAGS & set(flags)), found):
                if problem:
                    fail(problem)
            warnings.update(dict.fromkeys(found))
    except ConfigError as error:
        fail(str(error))
    if os.environ.get("RANK", "0") == "0":
        for warning in warnings:
            print(f"sluice: config warning: {warning}", file=sys.stderr)


def main() -> None:
    """Entry point used by train.py: register the schema, preflight, then hand over to Hydra."""
    register_schema()
    flags, overrides = split_argv(sys.argv[1:])
    if {"--help", "-h"} & set(flags):  # the key tables are read from the schema, not kept in a template
        from training.config.key_docs import help_text  # the key tables read every model's fields: --help only

        print(help_text(tuple(overrides)))
        sys.exit(0)
    preflight(sys.argv[1:])
    from training.launch.workers import hydra_main, under_torchrun  # the loop, models, DCP: once a run starts

    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        # Only rank 0 owns the run directory and its logs; the others learn its path from rank 0.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled"]

    hydra_main()
