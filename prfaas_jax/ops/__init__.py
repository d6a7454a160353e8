"""Pure math of the sequence-mixing ops, one subpackage per op.

Each op is a triad with one signature: ``reference.py`` (token-by-token ``lax.scan`` in fp32, the
obviously-right version), ``chunk.py`` (chunked ``jnp``, the CPU default for prefill) and, later,
``pallas.py`` (a kernel). The layout is always ``[B, T, H, K]``; recurrent states are
``[B, H, K, V]`` fp32 so that ``S^T q`` is the read-out. Ops know nothing about layers, params or
requests: q/k normalisation, gate activations and padding policy belong to the caller.

- ``kda``: Kimi Delta Attention, delta rule with a per-channel log decay.
- ``gdn``: Gated DeltaNet, delta rule with a per-head log decay.
- ``lightning``: Lightning attention, constant per-head decay, no delta rule.
"""
