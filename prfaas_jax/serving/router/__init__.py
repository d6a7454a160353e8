"""The router process: the request path (``core``), the control loop (``control``), per-request
records, worker handles, stats and metrics (``python -m prfaas_jax.serving.router.main``)."""
