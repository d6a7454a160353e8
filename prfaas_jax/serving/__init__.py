"""The serving plane: gRPC router, prefill and decode workers, link shaper, launcher, tools.

Services are thin adapters over `prfaas_jax.engine` and `prfaas_jax.policy`; docs/serving.md
describes the processes, the API (proto/prfaas.proto) and the config keys.
"""
