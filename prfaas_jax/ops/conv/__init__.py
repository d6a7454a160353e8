"""Depthwise causal short convolution with a carried tail (the KDA / GDN input conv)."""

from prfaas_jax.ops.conv.short_conv import short_conv, short_conv_reference

__all__ = ["short_conv", "short_conv_reference"]
