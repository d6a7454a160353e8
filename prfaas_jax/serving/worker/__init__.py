"""The worker process: prefill and decode services over the engines, the prefix-cache service,
engine construction and fault injection (``python -m prfaas_jax.serving.worker.main``)."""
