"""Token mixers, one module per family: ``delta`` (KDA, GDN), ``lightning``, ``mla``, ``gqa``
(GQA, SWA). Each exposes ``init_params`` and ``apply(…, x, state, ctx) -> (y, state)``."""
