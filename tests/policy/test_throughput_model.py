"""Eqs. 3–8, profiles, length distributions and the search, checked against hand-computed numbers.

Every expected value below is worked out in the comment beside it, or comes from an independent
oracle computed in the test (numerical integration, Monte Carlo), never from the code under test.
"""

import dataclasses
import math

import numpy as np
import pytest

from prfaas_jax.planning.paper_tables import TABLE6
from prfaas_jax.policy.length_distribution import EmpiricalLengths, TruncatedLogNormal
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.search import (
    best_point,
    homogeneous_pd,
    local_splits,
    naive_heterogeneous,
    search,
    threshold_grid,
)
from prfaas_jax.policy.throughput_model import (
    Cluster,
    Deployment,
    OperatingPoint,
    StageThroughputs,
    StageTime,
    ThroughputModel,
    gbps_to_mib_per_s,
    mib_per_s_to_gbps,
    pd_decode_throughput,
    pd_prefill_throughput,
    prefill_imbalance,
    prfaas_throughput,
    producer_consumer_gap,
    stage_bounds,
)

# --- the equations on literal numbers ---------------------------------------------------------


def test_units_mib_and_gbps():
    # 1 MiB/s = 8 · 2^20 bit/s = 0.008388608 Gbps.
    assert mib_per_s_to_gbps(1.0) == pytest.approx(0.008388608, rel=1e-12)
    assert gbps_to_mib_per_s(0.008388608) == pytest.approx(1.0, rel=1e-12)


def test_eq3_prfaas_compute_bound():
    # compute 4 / 2.0 s = 2.0 req/s; link 100e9 / (800 · 8 · 2^20) = 14.901 req/s.
    assert prfaas_throughput(4, 2.0, 100.0, 800.0) == pytest.approx(2.0)


def test_eq3_prfaas_bandwidth_bound():
    # link 5e9 / (800 · 8388608) = 0.74505806 req/s < compute 2.0 req/s.
    assert prfaas_throughput(4, 2.0, 5.0, 800.0) == pytest.approx(0.7450580596923828, rel=1e-12)


def test_eq4_pd_prefill():
    # Table 6's PD-prefill: 3 instances at 1.83 s each → 1.6393 req/s.
    assert pd_prefill_throughput(3, 1.83) == pytest.approx(1.639344262295082, rel=1e-12)


def test_eq5_pd_decode():
    # 5 · 20 / (0.025 s · 1024) = 100 / 25.6 = 3.90625 req/s (Table 6: 3.91).
    assert pd_decode_throughput(5, 20, 0.025, 1024) == pytest.approx(3.90625, rel=1e-12)


# Table 6's PrfaaS-PD stages: Θ_prfaas 1.61, Θ_pd-p 1.64, Θ_pd-d 3.91 req/s at p = 0.496.
TABLE6_STAGES = StageThroughputs(
    TABLE6.prfaas_pd.prfaas, TABLE6.prfaas_pd.pd_prefill, TABLE6.prfaas_pd.pd_decode
)


def test_eq6_bounds_and_lambda_max():
    stages = TABLE6_STAGES
    assert (stages, TABLE6.offload_fraction) == (StageThroughputs(1.61, 1.64, 3.91), 0.496)
    # 1.61 / 0.496 = 3.2459677, 1.64 / 0.504 = 3.2539683.
    bounds = stage_bounds(TABLE6.offload_fraction, stages)
    assert bounds == pytest.approx((3.2459677419354840, 3.2539682539682540, 3.91), rel=1e-12)
    assert min(bounds) == pytest.approx(3.245967741935484, rel=1e-12)


def test_eq6_idle_stages_do_not_bind():
    assert stage_bounds(0.0, StageThroughputs(None, 2.11, 2.34)) == (math.inf, 2.11, 2.34)
    assert stage_bounds(1.0, StageThroughputs(2.43, None, 6.25)) == (2.43, math.inf, 6.25)


def test_eq7_eq8_residuals():
    stages = TABLE6_STAGES
    # 3.2459677 − 3.2539683 = −0.0080005;  1.61 + 1.64 − 3.91 = −0.66.
    imbalance = prefill_imbalance(TABLE6.offload_fraction, stages)
    assert imbalance == pytest.approx(-0.008000512032770, rel=1e-9)
    assert producer_consumer_gap(stages) == pytest.approx(-0.66, rel=1e-12)


# --- profiles ----------------------------------------------------------------------------------


def test_polynomial_profile():
    # 1 + 2·2 + 3·2² = 17.
    assert Profile.polynomial([1.0, 2.0, 3.0])(2.0) == pytest.approx(17.0)


def test_table_profile_interpolates_and_extends_linearly():
    table = Profile.table([1024, 8192, 32768], [190.8, 308.9, 701.3])
    assert table(1024) == pytest.approx(190.8)
    assert table(8192) == pytest.approx(308.9)
    assert table(4608) == pytest.approx((190.8 + 308.9) / 2)  # midpoint of the first segment
    # Below 1024 the first segment continues: 190.8 − 1024 · 118.1/7168 = 173.928571.
    assert table(0) == pytest.approx(173.92857142857142)
    # Above 32768 the last one does: 701.3 + 32768 · 392.4/24576 = 1224.5.
    assert table(65536) == pytest.approx(1224.5)


@pytest.mark.parametrize(
    ("lengths", "values"),
    [([1024], [1.0]), ([1024, 1024], [1.0, 2.0]), ([2048, 1024], [1.0, 2.0]), ([1, 2], [1.0])],
)
def test_table_profile_rejects_bad_tables(lengths, values):
    with pytest.raises(ValueError, match="profile table"):
        Profile.table(lengths, values)


# --- length distributions ----------------------------------------------------------------------

CASE = TruncatedLogNormal(mu=9.90, sigma=1.00, min_len=128, max_len=131072)


def _lognormal_integral(f, a, b):
    """∫ f(l) · pdf(l) dl over [a, b] of CASE, by the trapezoid rule in z = (ln l − μ)/σ."""
    z = np.linspace((math.log(a) - 9.90) / 1.00, (math.log(b) - 9.90) / 1.00, 400_001)
    density = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return np.trapezoid(f(np.exp(9.90 + 1.00 * z)) * density, z)


def test_truncated_lognormal_matches_numerical_integration():
    mass = _lognormal_integral(np.ones_like, 128, 131072)
    above = _lognormal_integral(np.ones_like, 19400, 131072) / mass
    assert CASE.tail_prob(19400) == pytest.approx(above, rel=1e-8)
    mean_above = _lognormal_integral(lambda l: l, 19400, 131072) / (above * mass)
    mean_below = _lognormal_integral(lambda l: l, 128, 19400) / ((1 - above) * mass)
    assert CASE.mean_above(19400) == pytest.approx(mean_above, rel=1e-8)
    assert CASE.mean_below(19400) == pytest.approx(mean_below, rel=1e-8)

    quadratic = Profile.polynomial([0.3891, 4.107e-5, 9.476e-11])
    expected_t = _lognormal_integral(
        lambda l: 0.3891 + 4.107e-5 * l + 9.476e-11 * l**2, 19400, 131072
    ) / (above * mass)
    assert CASE.expect_above(quadratic, 19400) == pytest.approx(expected_t, rel=1e-8)

    table = Profile.table([1024, 8192, 32768, 131072], [190.8, 308.9, 701.3, 2316.3])
    interpolated = _lognormal_integral(
        lambda l: np.interp(
            l, [0, 1024, 8192, 32768, 131072], [173.9286, 190.8, 308.9, 701.3, 2316.3]
        ),
        128,
        19400,
    ) / ((1 - above) * mass)
    assert CASE.expect_below(table, 19400) == pytest.approx(interpolated, rel=1e-5)


def test_truncated_lognormal_matches_monte_carlo():
    rng = np.random.default_rng(0)
    samples = rng.lognormal(9.90, 1.00, size=4_000_000)
    samples = samples[(samples >= 128) & (samples <= 131072)]
    long = samples[samples > 19400]
    assert CASE.tail_prob(19400) == pytest.approx(long.size / samples.size, abs=2e-3)
    assert CASE.mean_above(19400) == pytest.approx(long.mean(), rel=5e-3)
    assert CASE.mean_below(19400) == pytest.approx(samples[samples <= 19400].mean(), rel=5e-3)


def test_truncated_lognormal_case_study_statistics():
    # docs/planning.md, calibration: p(19,400) = 0.4957, E[L|L>t] ≈ 45.0K, E[L|L≤t] ≈ 10.2K,
    # mean ≈ 27.5K.
    assert CASE.tail_prob(19400) == pytest.approx(0.4957, abs=1e-4)
    assert CASE.mean_above(19400) == pytest.approx(45_000, rel=5e-3)
    assert CASE.mean_below(19400) == pytest.approx(10_200, rel=5e-3)
    assert CASE.mean_above(-math.inf) == pytest.approx(27_500, rel=5e-3)
    assert CASE.tail_prob(100) == 1.0
    assert CASE.tail_prob(131072) == 0.0


def test_empirical_lengths_by_hand():
    lengths = EmpiricalLengths((10, 1, 5, 3))  # sorted on construction
    assert lengths.lengths == (1, 3, 5, 10)
    assert lengths.support == (1.0, 10.0)
    assert lengths.tail_prob(3) == 0.5  # 5 and 10 are above 3
    assert lengths.mean_above(3) == 7.5  # (5 + 10) / 2
    assert lengths.mean_below(3) == 2.0  # (1 + 3) / 2
    # f(l) = 1 + l²: ((1 + 25) + (1 + 100)) / 2 = 63.5.
    assert lengths.expect_above(Profile.polynomial([1.0, 0.0, 1.0]), 3) == 63.5
    # Table through (0, 0) and (4, 8), i.e. 2·l: (2 + 6) / 2 = 4.
    assert lengths.expect_below(Profile.table([0, 4], [0.0, 8.0]), 3) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no requests"):
        lengths.mean_above(10)


def test_empirical_lengths_accept_numpy_ints_and_refuse_floats():
    assert EmpiricalLengths(tuple(np.array([3, 1], dtype=np.int64))).lengths == (1, 3)
    with pytest.raises(ValueError, match="integers"):
        EmpiricalLengths((1.5, 2))


# --- the model on a deployment small enough to compute by hand ----------------------------------

TRACE = EmpiricalLengths((1000, 2000, 3000, 4000))


def _model(
    egress_gbps: float = 10.0, stage_time: StageTime = StageTime.EXPECTED
) -> ThroughputModel:
    deployment = Deployment(
        local=Cluster(2, Profile.polynomial([0.0, 0.0, 1e-6])),  # T = l² µs: 1, 4, 9, 16 s
        decode_max_batch_size=10,
        decode_step_s=0.05,
        kv_size_mib=Profile.polynomial([100.0, 0.1]),  # 100 MiB + 0.1 MiB/token
        prfaas=Cluster(2, Profile.polynomial([0.0, 1e-3])),  # 1 ms/token: 1, 2, 3, 4 s
        egress_gbps=egress_gbps,
    )
    return ThroughputModel(deployment, TRACE, output_len=100, stage_time=stage_time)


def test_model_expected_stage_time_by_hand():
    point = _model().evaluate(2500, 1, 1)
    routing = point.routing
    assert routing.offload_fraction == 0.5
    assert (routing.mean_long_len, routing.mean_short_len) == (3500, 1500)
    assert routing.prfaas_prefill_s == pytest.approx(3.5)  # (3 + 4) / 2
    assert routing.pd_prefill_s == pytest.approx(2.5)  # (1 + 4) / 2, not T(1500) = 2.25
    assert routing.kv_mib == pytest.approx(450.0)  # 100 + 0.1 · 3500
    # Θ_prfaas = min(2/3.5, 10e9/(450 · 8388608)) = min(0.5714, 2.649); Θ_pd-p = 1/2.5;
    # Θ_pd-d = 1 · 10 / (0.05 · 100) = 2; Λ = min(0.5714/0.5, 0.4/0.5, 2) = 0.8.
    assert point.stages.prfaas == pytest.approx(2 / 3.5)
    assert point.stages.pd_prefill == pytest.approx(0.4)
    assert point.stages.pd_decode == pytest.approx(2.0)
    assert point.lambda_max == pytest.approx(0.8)
    # egress = p · Λ · S = 0.5 · 0.8 · 450 MiB/s = 180 MiB/s = 1.50994944 Gbps.
    assert point.egress_gbps == pytest.approx(1.50994944, rel=1e-9)


def test_model_time_at_mean_by_hand():
    point = _model(stage_time=StageTime.AT_MEAN).evaluate(2500, 1, 1)
    assert point.routing.pd_prefill_s == pytest.approx(2.25)  # T(1500) = 1500² µs
    assert point.stages.pd_prefill == pytest.approx(1 / 2.25)


def test_model_bandwidth_bound_saturates_the_link():
    point = _model(egress_gbps=1.0).evaluate(2500, 1, 1)
    # Θ_prfaas = 1e9 / (450 · 8388608) = 1e9 / 3774873600 = 0.26490953 < 2/3.5; Λ = 2 · that.
    assert point.stages.prfaas == pytest.approx(0.2649095323350694, rel=1e-9)
    assert point.lambda_max == pytest.approx(0.5298190646701388, rel=1e-9)
    assert point.egress_gbps == pytest.approx(1.0, rel=1e-9)


def test_model_rejects_impossible_requests():
    with pytest.raises(ValueError, match="exceed"):
        _model().evaluate(2500, 2, 1)
    no_prfaas = ThroughputModel(
        Deployment(Cluster(2, Profile.polynomial([1.0])), 10, 0.05, Profile.polynomial([1.0])),
        TRACE,
        output_len=100,
    )
    with pytest.raises(ValueError, match="no PrfaaS cluster"):
        no_prfaas.routing_at(2500)


# --- the search ----------------------------------------------------------------------------------


def test_threshold_grid_and_splits():
    assert threshold_grid(TRACE, 1000) == (2000, 3000)  # strictly inside [1000, 4000]
    assert threshold_grid(TRACE, 700) == (1400, 2100, 2800, 3500)
    assert local_splits(4) == ((1, 3), (2, 2), (3, 1))


def _with_bounds(point: OperatingPoint, lambda_max: float, prefill_bound: float):
    """`point` with both Eq. 6 prefill bounds equal to `prefill_bound` and the given Λ_max."""
    p = point.routing.offload_fraction
    stages = StageThroughputs(prefill_bound * p, prefill_bound * (1 - p), lambda_max)
    return dataclasses.replace(point, stages=stages, lambda_max=lambda_max)


def test_best_point_prefers_higher_lambda_then_prefill_headroom():
    base = _model().evaluate(2500, 1, 1)
    low = _with_bounds(base, 0.5, prefill_bound=0.9)
    high = _with_bounds(base, 0.5, prefill_bound=1.2)
    better = _with_bounds(base, 0.6, prefill_bound=0.6)
    assert best_point([low, high]) is high
    assert best_point([high, low]) is high
    assert best_point([high, better, low]) is better


def test_baselines_by_hand():
    model = _model()
    # Homogeneous PD on 4 instances: E[T] = (1 + 4 + 9 + 16)/4 = 7.5 s, decode 2 req/s per
    # instance; splits give min(1/7.5, 6), min(2/7.5, 4), min(3/7.5, 2) → 3/1 at 0.4.
    baseline = ThroughputModel(
        Deployment(
            Cluster(4, model.deployment.local.prefill_s), 10, 0.05, Profile.polynomial([1.0])
        ),
        TRACE,
        output_len=100,
    )
    homogeneous = homogeneous_pd(baseline)
    assert (homogeneous.num_pd_prefill, homogeneous.num_pd_decode) == (3, 1)
    assert homogeneous.lambda_max == pytest.approx(0.4)
    # Naive: all on PrfaaS, E[T] = 2.5 s → 2/2.5 = 0.8; S = 100 + 250 = 350 MiB → link 3.41;
    # decode 2 · 2 = 4 → Λ = 0.8.
    naive = naive_heterogeneous(model)
    assert (naive.num_prfaas, naive.num_pd_prefill, naive.num_pd_decode) == (2, 0, 2)
    assert naive.routing.offload_fraction == 1.0
    assert naive.lambda_max == pytest.approx(0.8)

    plan = search(model, baseline, thresholds=(1500, 2500, 3500))
    # Only split 1/1 exists; t = 2500 gives 0.8 (above); t = 1500: p = 0.75, Θ_prfaas = 2/3 →
    # 0.889, Θ_pd-p = 1/1 → 4; decode 2 → Λ = 0.889; t = 3500: p = 0.25, Θ_prfaas = 0.5 → 2,
    # Θ_pd-p = 3/14 → 0.286. Best: t = 1500 at 8/9.
    assert plan.best.routing.threshold == 1500
    assert plan.best.lambda_max == pytest.approx(8 / 9)
    assert plan.speedup_vs_homogeneous == pytest.approx((8 / 9) / 0.4)
    assert plan.speedup_vs_naive == pytest.approx((8 / 9) / 0.8)
    # Costs: 2 + 2 instances of 8 GPUs at 1.0 = 32, baseline 4 · 8 = 32: equal-cost = speedup.
    assert plan.equal_cost_speedup_vs_homogeneous == pytest.approx(plan.speedup_vs_homogeneous)
