"""The run config's public face: the schema, validate() and the errors it raises (one home each, re-exported)."""

from training.config.values import ConfigError
from training.config.schema import CONF_DIR, model_config, register_schema
from training.config.validate import validate

__all__ = ["CONF_DIR", "ConfigError", "model_config", "register_schema", "validate"]
