"""prfaas_jax: Prefill-as-a-Service for hybrid-attention LLMs, in JAX.

Layers, from the bottom up (docs/design.md §2): a module imports only its own layer and the
layers above it in this list, never one below (tests/test_layering.py).

0. ``errors``, ``config``, ``toml_config``, ``tables``, ``mesh_spec``, ``state_bytes``,
   ``wire_precision``, ``prefix_events``
1. ``ops``
2. ``model``
3. ``train``, ``engine`` (side by side)
4. ``policy``
5. ``planning``
6. ``sim``
7. ``serving``
8. ``cli``
"""

__version__ = "0.1.0"
