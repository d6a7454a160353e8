"""Depthwise causal short convolution with a carried tail (the KDA / GDN input conv):
``short_conv`` (shifted-sum form) and ``short_conv_reference`` (its token-by-token oracle)."""

from prfaas_jax.ops.conv.short_conv import short_conv, short_conv_reference

__all__ = ["short_conv", "short_conv_reference"]
