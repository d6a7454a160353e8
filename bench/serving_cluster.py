"""``cluster_sections``: the config of the single-node cluster bench/serving.py serves its
checkpoint with, and the ``--set`` settings over it.

One PD prefill and one PD decode worker, no PrfaaS instance, the controller and the prefix
cache off (the prompts share nothing); buckets every power of two from 32 up to ``max_len``,
one chunk the largest of them. A setting is ``SECTION.KEY=VALUE`` with the value in TOML's
spelling (``engine.prefill_batch_rows=1``, ``model.impl="chunk"``); the cluster's own loader
then checks it like any key of a config file.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path


def cluster_sections(
    ckpt: Path | str, impl: str, max_len: int, max_slots: int, settings: Sequence[str] = ()
) -> dict[str, dict]:
    """The cluster's sections for ``prfaas_jax.toml_config.dumps``: the checkpoint at ``ckpt``
    run with ``[model] impl``, ``max_len`` tokens per sequence, ``max_slots`` decode slots, then
    each of ``settings`` over them."""
    buckets = [2**k for k in range(5, max_len.bit_length()) if 2**k <= max_len]
    sections: dict[str, dict] = {
        "model": {"preset": str(ckpt), "impl": impl},
        "engine": {
            "max_len": max_len,
            "chunk_len": buckets[-1],
            "buckets": buckets,
            "max_slots": max_slots,
        },
        "instances": {"prfaas_prefill": 0, "pd_prefill": 1, "pd_decode": 1},
        "controller": {"enabled": False},
        "prefix_cache": {"enabled": False},
    }
    for setting in settings:
        name, _, value = setting.partition("=")
        section, _, key = name.strip().partition(".")
        if not (section and key and value.strip()):
            raise ValueError(f"--set {setting!r}: expected SECTION.KEY=VALUE")
        try:
            sections.setdefault(section, {})[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--set {setting!r}: the value is not TOML ({err})") from None
    return sections
