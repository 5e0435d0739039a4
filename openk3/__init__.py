"""openk3: the Kimi K3 system in one readable PyTorch codebase."""

from openk3.checkpoint import from_hf, load_pretrained, save_pretrained, to_hf
from openk3.config import ModelConfig, preset
from openk3.model import KimiForCausalLM, ModelCache, build_model
from openk3.serve.llm import LLM
from openk3.serve.sampler import SamplingParams

__all__ = ["ModelConfig", "preset", "from_hf", "to_hf", "KimiForCausalLM", "ModelCache",
           "build_model", "load_pretrained", "save_pretrained", "LLM", "SamplingParams"]
__version__ = "0.1.0"
