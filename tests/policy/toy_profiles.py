"""The toy cluster the threshold controller's and the scheduler's tests run on (`PROFILES`):
PrfaaS prefill 1 ms/token, PD prefill 2 ms/token, state 1 KiB/token, decode 8 slots at
10 ms/step."""

from prfaas_jax.policy.live_model import LiveProfiles
from prfaas_jax.policy.profiles import Profile

PROFILES = LiveProfiles(
    prfaas_prefill_s=Profile.polynomial([0.0, 0.001]),
    pd_prefill_s=Profile.polynomial([0.0, 0.002]),
    kv_size_mib=Profile.polynomial([0.0, 1 / 1024]),
    decode_max_batch_size=8,
    decode_step_s=0.01,
)
