"""The run config's public face: the schema and the error its checks raise (one home each, re-exported). The pre-launch
check, validate(), is training.config.validate: it reads every part of training/ below it."""

from training.rules.values import ConfigError
from training.config.schema import CONF_DIR, model_config, register_schema

__all__ = ["CONF_DIR", "ConfigError", "model_config", "register_schema"]
