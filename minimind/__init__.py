"""MiniMind-3 model, pure single-device PyTorch, registered with the transformers Auto classes."""

from transformers import AutoConfig, AutoModelForCausalLM

from .config import MiniMindConfig
from .model import MiniMindForCausalLM, MiniMindModel

AutoConfig.register("minimind", MiniMindConfig, exist_ok=True)
AutoModelForCausalLM.register(MiniMindConfig, MiniMindForCausalLM, exist_ok=True)

__all__ = ["MiniMindConfig", "MiniMindForCausalLM", "MiniMindModel"]
