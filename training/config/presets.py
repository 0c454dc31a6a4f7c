"""Config-group presets: the files under conf/, and a `schedule=<name>` preset of every registered schedule (the
schedule registry is their one home; conf/schedule/ holds only `table` and `module`)."""

from pathlib import Path

from hydra.core.config_store import ConfigStore
from parallel.pipeline.schedules import SCHEDULES

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"  # the config groups of `python train.py`


def store_presets(schema: type) -> None:
    """`base_config` (the schema, for conf/config.yaml's defaults list) and `schedule=<name>` for every registered
    schedule: its name and the micro-batches it asks for, if any."""
    ConfigStore.instance().store(name="base_config", node=schema)
    for name, registered in SCHEDULES.items():
        preset = {"name": name, "n_microbatches": registered.n_microbatches}
        ConfigStore.instance().store(group="schedule", name=name, node={k: v for k, v in preset.items() if v})


def group_presets(group: str) -> list[str]:
    """The presets of a config group: its files under conf/ and the ones `store_presets` stores."""
    stored = ConfigStore.instance().repo.get(group, {})
    return sorted({p.stem for p in (CONF_DIR / group).glob("*.yaml")} | {Path(n).stem for n in stored})
