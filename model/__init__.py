"""The GPT model: config, blocks, and the attention backends it switches between."""
from model.config import ModelConfig
from model.gpt import GPT

__all__ = ["GPT", "ModelConfig"]
