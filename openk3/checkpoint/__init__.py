from openk3.checkpoint.hf import CheckpointError, load_pretrained, save_pretrained
from openk3.checkpoint.hf_config import from_hf, to_hf

__all__ = ["CheckpointError", "from_hf", "load_pretrained", "save_pretrained", "to_hf"]
