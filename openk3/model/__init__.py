from openk3.model.cache import ModelCache
from openk3.model.model import KimiForCausalLM, build_model

__all__ = ["KimiForCausalLM", "ModelCache", "build_model"]
