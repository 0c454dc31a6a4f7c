"""Command-line front door: compose and validate every job of the command line before Hydra runs it."""

import itertools
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from training.config import ConfigError, register_schema, validate

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
EXIT_CONFIG_ERROR = 2
# Flags after which Hydra takes one value; the value is not an override.
VALUE_FLAGS = {"-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "--cfg", "-c", "-p",
               "--package", "--experimental-rerun", "--shell-completion", "-sc"}
# Informational flags: Hydra answers them itself, nothing to validate.
INFO_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc"}
MAX_PREFLIGHT_JOBS = 256


def fail(message: str) -> None:
    """Print one line and leave with the config-error exit code."""
    print(f"sluice: config error: {message}", file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)


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


def expand_jobs(overrides: list[str]) -> list[list[str]]:
    """The override lists of every job in a sweep (one list when nothing sweeps); hydra.* keys dropped."""
    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(job) for job in itertools.islice(itertools.product(*choices), MAX_PREFLIGHT_JOBS)]


def explain_compose_error(error: Exception, job: list[str]) -> str:
    """Turn Hydra's multi-line composition error into one line that names the key and the fix."""
    text = str(error).strip()
    if error.__cause__ is not None:  # OmegaConf's reason (e.g. a type mismatch) hides in the cause
        text += "\n" + str(error.__cause__).strip()
    for override in job:
        key, _, value = override.lstrip("+~").partition("=")
        group_dir = CONF_DIR / key
        if group_dir.is_dir() and f"'{key}/{value}'" in text:
            presets = sorted(p.stem for p in group_dir.glob("*.yaml"))
            return f"{key}={value}: no such preset; use one of {', '.join(presets)}"
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(
        ("full_key", "object_type", "reference_type", "Set the environment"))]
    detail = " ".join(lines[:2]) if lines else type(error).__name__
    return f"{detail} (check the override; `python train.py --cfg job` prints every key and value)"


def preflight(argv: list[str]) -> None:
    """Compose and validate each job of this command line; exit 2 with one line on the first problem."""
    flags, overrides = split_argv(argv)
    if INFO_FLAGS & set(flags):
        return
    try:
        jobs = expand_jobs(overrides)
    except Exception as error:  # Hydra's grammar errors: report the line, not the parser's traceback
        fail(f"cannot parse overrides {' '.join(overrides)}: {str(error).splitlines()[0]}")
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    for job in jobs:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            try:
                cfg = compose(config_name="config", overrides=job)
            except Exception as error:
                fail(explain_compose_error(error, job))
        try:
            validate(cfg, world_size)
        except ConfigError as error:
            fail(str(error))
    GlobalHydra.instance().clear()


def main() -> None:
    """Entry point used by train.py: register the schema, preflight, then hand over to Hydra."""
    register_schema()
    preflight(sys.argv[1:])
    from training.launch import hydra_main, under_torchrun

    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        # Only rank 0 owns the run directory and its logs; the others learn its path from rank 0.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled"]

    hydra_main()
