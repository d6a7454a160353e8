"""The router's per-request prefix-cache rule: `CacheRule` (`[router] cache_rule`).

Paper §3.4.3 has two rules for a request whose prefix is cached: bandwidth-scarce (each cluster
judged on its own cache) and bandwidth-abundant (the best prefix anywhere, moved across the link
when it sits in the other cluster). With ``cache_rule = "auto"`` (the default) the router picks
per request: the abundant rule exactly when moving the longer cached prefix across — its state,
``S_kv(l)``, over the link's spare capacity (the capacity learned from the transfers, less what
the recent egress uses) plus latency — takes less time than the prefill the receiving cluster
would otherwise spend on the tokens it lacks (``[profile]``), and the link is below the
controller's ``high_utilization`` (`policy.routing.choose_abundant`). ``"scarce"`` and
``"abundant"`` fix the rule. `counts` says how often each rule decided a request the two rules
would route differently.
"""

from __future__ import annotations

from prfaas_jax.config import ModelConfig
from prfaas_jax.policy.routing import ClusterKind, InstanceLoad, LinkView, choose_abundant
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.router.handles import kv_size_profile, prefill_profiles


class CacheRule:
    """The rule for each request (module docstring); the caller serialises calls."""

    def __init__(self, config: ClusterConfig, cfg: ModelConfig) -> None:
        self.rule = config.router.cache_rule
        self.max_utilization = config.controller_config().high_utilization
        self.counts = {"scarce": 0, "abundant": 0}
        self._prefill_s = prefill_profiles(config)
        # A prefix moves as an exact copy (`PrefixCache.Export`), whatever `[link] precision`.
        self._kv_mib = kv_size_profile(cfg, config.engine.max_len)

    def abundant(
        self,
        prompt_len: int,
        prfaas: tuple[InstanceLoad, ...],
        pd_prefill: tuple[InstanceLoad, ...],
        link: LinkView,
    ) -> bool:
        """Whether this request is routed by the bandwidth-abundant rule."""
        if self.rule != "auto":
            return self.rule == "abundant"
        cap = prompt_len - 1
        l_prfaas = min(max((i.cached_len for i in prfaas), default=0), cap)
        l_pd = min(max((i.cached_len for i in pd_prefill), default=0), cap)
        if l_prfaas == l_pd or not (prfaas and pd_prefill):
            return False  # the two rules agree
        longer, own = max(l_prfaas, l_pd), min(l_prfaas, l_pd)
        # The prefix would move to the cluster that holds less of it.
        target = self._prefill_s[ClusterKind.PD if l_prfaas > l_pd else ClusterKind.PRFAAS]
        chosen = choose_abundant(
            move_bytes=self._kv_mib(longer) * 2**20,
            recompute_s=target(longer) - target(own),
            link=link,
            max_utilization=self.max_utilization,
        )
        self.counts["abundant" if chosen else "scarce"] += 1
        return chosen
