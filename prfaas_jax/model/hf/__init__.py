"""Hugging Face import: read a checkpoint directory (``reader``), map each family's tensors onto
this project's params (one module per family, shared layer mappings in ``layers``), and
``load_hf`` / ``convert_hf`` (``importer``)."""

from prfaas_jax.model.hf.importer import convert_hf, hf_config, load_hf

__all__ = ["convert_hf", "hf_config", "load_hf"]
