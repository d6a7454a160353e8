"""The discrete-event cluster simulator: arrivals, PrfaaS / PD-prefill / PD-decode instances,
a shared inter-cluster link and per-instance prefix caches, driven by the same policy objects
(``prfaas_jax.policy``) as the router. Pure Python: no JAX, no gRPC."""
