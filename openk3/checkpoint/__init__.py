from openk3.checkpoint.hf import CheckpointError, load_pretrained, save_pretrained

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained"]
