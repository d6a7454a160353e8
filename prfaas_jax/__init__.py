"""prfaas_jax: Prefill-as-a-Service for hybrid-attention LLMs, in JAX.

Packages, from the bottom up (imports only go down this list; docs/design.md §2):
``errors``, ``config``, ``toml_config``, ``tables`` → ``ops`` → ``model`` → ``engine`` → ``policy``
→ ``planning`` → ``sim`` → ``serving`` → ``cli``.
"""

__version__ = "0.1.0"
