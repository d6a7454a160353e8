"""Pure math of the sequence-mixing ops, one subpackage per op.

Each op comes in implementations with one signature. The linear ops are triads:
``reference.py`` (token-by-token ``lax.scan`` in fp32, the obviously-right version), ``chunk.py``
(chunked ``jnp``, the CPU default for prefill) and ``pallas.py`` (a Pallas kernel, interpreted on
CPU, compiled on accelerators), named ``<op>_reference``, ``<op>_chunk`` and ``<op>_pallas``. The
layout is always ``[B, T, H, K]``; recurrent states are ``[B, H, K, V]`` fp32 so that ``S^T q`` is
the read-out. Ops know nothing about layers, params or requests: q/k normalisation, gate
activations and padding policy belong to the caller.

- ``delta_rule``: the gated delta rule (``delta_rule_*``), as KDA (Kimi Delta Attention, a log
  decay per key channel: ``kda_*``) and GDN (Gated DeltaNet, a log decay per head: ``gdn_*``).
- ``lightning``: Lightning attention, constant per-head decay, no delta rule.
- ``attention``: softmax attention, ``reference.py`` (masked GQA/SWA with sinks, its blocked path,
  absorbed MLA decode), ``flash_pallas.py`` (prefill kernel), ``mla_decode_pallas.py`` (MLA decode
  kernel).
- ``conv``: the depthwise causal short convolution before KDA / GDN.

Shared code: ``recurrence.py`` (chunk layout and segment sums of the jnp linear ops),
``pallas_launch.py`` (tiling, padding and launch helpers of the kernels, ``StateBlockSizes``),
``pallas_backend.py`` (what differs between Triton and Mosaic: tile rules, SMEM scalars, launch
parameters, the target backend) and ``dispatch.py`` (``Impl`` and the table from op and
implementation to function).
"""
