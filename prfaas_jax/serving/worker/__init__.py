"""The worker process: prefill and decode services over the engines (their state transfers:
`serving/transfer/`), the prefix-cache service and engine construction
(``python -m prfaas_jax.serving.worker.main``)."""
