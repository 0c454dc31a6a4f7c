"""The model families Sluice trains (MiniMind, transformers' Llama / Qwen3 / Qwen3-MoE) and their adapters.

A family is its transformers classes (which declare the plans `parallel.decoder` reads) plus one adapter for what
a plan cannot say. This package sits between `parallel` (which names no model) and `checkpoint` / `training`.
"""

from models.family import (ADAPTERS, ModelError, build_model, config_from_record, config_record, decoder_of, family_of,
                           hf_config_folder, model_config, native)

__all__ = ["ADAPTERS", "ModelError", "build_model", "config_from_record", "config_record", "decoder_of", "family_of",
           "hf_config_folder", "model_config", "native"]
