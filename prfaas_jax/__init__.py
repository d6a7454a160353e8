"""prfaas_jax: Prefill-as-a-Service for hybrid-attention LLMs, in JAX.

Packages, from the bottom up (imports only go down this list):
``config`` → ``ops`` → ``model`` → ``engine`` → ``policy`` → ``serving`` → ``planning`` → ``cli``.
"""

__version__ = "0.1.0"
