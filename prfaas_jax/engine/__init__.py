"""Engines around the model: prefill, decode, sampling, the state wire codec, the prefix cache."""
