"""The run config's public face: the schema, validate() and the errors it raises (one home each, re-exported)."""

from training.rules import ConfigError
from training.schema import CONF_DIR, model_config, register_schema
from training.validate import validate

__all__ = ["CONF_DIR", "ConfigError", "model_config", "register_schema", "validate"]
