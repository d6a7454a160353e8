"""Pure scheduling policy: the dual-timescale scheduler (`scheduler.py`: the threshold controller
and the rebalancer), routing, admission, the throughput model, length distributions, profiles and
the search.

No JAX, no gRPC, no clocks of its own: the router and the cluster simulator call the same objects.
"""
