"""`prfaas plan` end to end: the paper's Table 6 from configs/plans/case-study-1t.toml, the
bandwidth-bound regime, the JSON contract of the command, and one-line config errors."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from prfaas_jax.cli import main
from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.plan_config import load_plan_config
from prfaas_jax.policy.length_distribution import EmpiricalLengths
from prfaas_jax.policy.search import search
from prfaas_jax.policy.throughput_model import StageTime, gbps_to_mib_per_s

CASE_STUDY = Path(__file__).resolve().parents[2] / "configs" / "plans" / "case-study-1t.toml"


@pytest.fixture(scope="module")
def case_study():
    config = load_plan_config(CASE_STUDY)
    return config, search(config.model, config.baseline, thresholds=config.thresholds)


def test_case_study_reproduces_table_6(case_study):
    _, plan = case_study
    best = plan.best
    assert 17_500 <= best.routing.threshold <= 21_500  # paper: 19.4K
    assert (best.num_prfaas, best.num_pd_prefill, best.num_pd_decode) == (4, 3, 5)
    assert best.lambda_max == pytest.approx(3.24, rel=0.03)
    assert best.stages.prfaas == pytest.approx(1.61, rel=0.05)
    assert best.stages.pd_prefill == pytest.approx(1.64, rel=0.05)
    assert best.stages.pd_decode == pytest.approx(3.91, rel=0.05)
    assert best.routing.offload_fraction == pytest.approx(0.496, abs=0.005)
    assert best.routing.mean_long_len == pytest.approx(44_000, rel=0.05)  # paper: ≈ 44K
    assert 10.0 <= best.egress_gbps <= 16.0  # paper: ≈ 13 Gbps

    homogeneous = plan.homogeneous_pd
    assert (homogeneous.num_pd_prefill, homogeneous.num_pd_decode) == (9, 3)
    assert homogeneous.lambda_max == pytest.approx(2.11, rel=0.03)
    assert homogeneous.stages.pd_decode == pytest.approx(2.35, rel=0.05)

    naive = plan.naive_heterogeneous
    assert (naive.num_prfaas, naive.num_pd_prefill, naive.num_pd_decode) == (4, 0, 8)
    assert naive.lambda_max == pytest.approx(2.45, rel=0.05)
    assert naive.stages.pd_decode == pytest.approx(6.25, rel=0.05)

    assert plan.speedup_vs_homogeneous == pytest.approx(1.54, abs=0.05)
    assert plan.speedup_vs_naive == pytest.approx(3.24 / 2.45, rel=0.05)  # paper: +32%
    assert plan.equal_cost_speedup_vs_homogeneous == pytest.approx(1.15, abs=0.02)  # §4.4


def test_case_study_optimum_satisfies_eq7_and_leaves_decode_slack(case_study):
    _, plan = case_study
    prfaas_bound, pd_prefill_bound, decode_bound = plan.best.bounds
    # Eq. 7 holds to the 100-token grid; Eq. 8 cannot hold with integer counts, decode has slack.
    assert prfaas_bound == pytest.approx(pd_prefill_bound, rel=0.01)
    assert decode_bound > plan.best.lambda_max


def test_case_study_h200_profile_is_the_least_squares_fit_of_table_5():
    # docs/planning.md, calibration: the [derived] H200 coefficients fit Table 5 at 1024·k tokens.
    lengths = 1024 * np.array([1, 8, 32, 128])
    fit = np.polynomial.polynomial.polyfit(lengths, [0.44, 0.72, 1.84, 7.40], 2)
    profile = load_plan_config(CASE_STUDY).model.deployment.prfaas.prefill_s
    assert profile.coeffs[0] == pytest.approx(tuple(fit), rel=1e-3)


def test_case_study_time_at_mean_overstates_prfaas(case_study):
    # docs/planning.md, calibration: 4/T(l_long) = 1.645 req/s against 4/E[T(L) | L > t] = 1.607.
    config, _ = case_study
    model = dataclasses.replace(config.model, stage_time=StageTime.AT_MEAN)
    assert model.evaluate(19400, 3, 5).stages.prfaas == pytest.approx(1.645, rel=2e-3)
    assert config.model.evaluate(19400, 3, 5).stages.prfaas == pytest.approx(1.607, rel=2e-3)


def test_bandwidth_5_gbps_binds_and_raises_the_threshold(case_study):
    _, wide = case_study
    config = load_plan_config(CASE_STUDY, egress_gbps=5.0)
    plan = search(config.model, config.baseline, thresholds=config.thresholds)
    best = plan.best
    assert best.routing.threshold > wide.best.routing.threshold
    assert best.egress_gbps <= 5.0 * (1 + 1e-9)
    # The link term of Eq. 3 is the smaller one: Θ_prfaas = B_out / S_kv(l_long).
    link_bound = gbps_to_mib_per_s(5.0) / best.routing.kv_mib
    compute_bound = best.num_prfaas / best.routing.prfaas_prefill_s
    assert best.stages.prfaas == pytest.approx(link_bound)
    assert link_bound < compute_bound


JSON_KEYS = {
    "threshold_tokens",
    "n_prfaas",
    "n_pd_prefill",
    "n_pd_decode",
    "lambda_max",
    "stage_throughput",
    "offload_fraction",
    "mean_long_len",
    "mean_short_len",
    "egress_gbps",
    "baselines",
    "speedup_vs_homogeneous",
    "speedup_vs_naive",
}


def test_cli_json_keys(capsys):
    assert main(["plan", "--config", str(CASE_STUDY), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= JSON_KEYS
    assert set(out["stage_throughput"]) == {"prfaas", "pd_prefill", "pd_decode"}
    homogeneous = out["baselines"]["homogeneous_pd"]
    assert {"n_pd_prefill", "n_pd_decode", "lambda_max", "stage_throughput"} <= set(homogeneous)
    naive = out["baselines"]["naive_heterogeneous"]
    assert {"n_prfaas", "n_pd_decode", "lambda_max", "stage_throughput"} <= set(naive)
    assert out["threshold_tokens"] == 19400
    assert (out["n_prfaas"], out["n_pd_prefill"], out["n_pd_decode"]) == (4, 3, 5)
    assert out["lambda_max"] == pytest.approx(3.24, rel=0.03)


def test_cli_bandwidth_flag(capsys):
    assert main(["plan", "--config", str(CASE_STUDY), "--json", "--bandwidth", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["egress_gbps"] <= 5.0 * (1 + 1e-9)
    assert out["threshold_tokens"] > 21_500


def test_cli_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert main(["plan", "--config", str(CASE_STUDY), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "19,400" in out and "4 / 3 / 5" in out and "— / 9 / 3" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--json", "--plot", "--bandwidth"):
        assert flag in out


def _write_case_study(tmp_path: Path, old: str = "", new: str = "") -> Path:
    text = CASE_STUDY.read_text()
    assert old in text
    path = tmp_path / "plan.toml"
    path.write_text(text.replace(old, new, 1))
    return path


def test_cli_unknown_key_exits_2_with_one_line(tmp_path, capsys):
    path = _write_case_study(tmp_path, "egress_gbps = 100", "egress_gbps = 100\negress_gbsp = 5")
    assert main(["plan", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert "prfaas.egress_gbsp" in lines[0] and str(path) in lines[0]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("sigma = 1.00", "sigma = -1.0", "sigma must be positive"),
        ("instances = 4", 'instances = "four"', "prfaas.instances: expected an integer"),
        ("instances = 8", "instances = 1", "local.instances: must be at least 2"),
        ("output_len = 1024", "", "workload.output_len: missing key"),
        ('kind = "table"', 'kind = "spline"', "kv_size_mib.kind: expected one of"),
        ("values = [190.8, 308.9, 701.3, 2316.3]", "values = [1.0]", "as many values"),
        ('stage_time = "expected"', 'stage_time = "median"', "search.stage_time: expected one of"),
        ("[baseline]", "[baseline", "invalid TOML"),
    ],
)
def test_config_errors_are_one_line(tmp_path, old, new, message):
    path = _write_case_study(tmp_path, old, new)
    with pytest.raises(ConfigError) as err:
        load_plan_config(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read plan config"):
        load_plan_config(tmp_path / "absent.toml")


def test_trace_workload(tmp_path):
    (tmp_path / "lengths.txt").write_text("# uncached lengths\n4000\n1000\n\n3000\n2000  # one\n")
    path = _write_case_study(
        tmp_path,
        'distribution = "truncated_lognormal"\nmu = 9.90\nsigma = 1.00\nmin_len = 128\n'
        "max_len = 131072",
        'distribution = "trace"\npath = "lengths.txt"',
    )
    config = load_plan_config(path)
    assert config.model.lengths == EmpiricalLengths((1000, 2000, 3000, 4000))
    assert config.thresholds == tuple(range(1100, 4000, 100))  # strictly inside [1000, 4000]
    plan = search(config.model, config.baseline, thresholds=config.thresholds)
    assert math.isfinite(plan.best.lambda_max) and plan.best.lambda_max > 0


def test_trace_with_a_bad_line(tmp_path):
    (tmp_path / "lengths.txt").write_text("1000\nlots\n")
    path = _write_case_study(
        tmp_path,
        'distribution = "truncated_lognormal"\nmu = 9.90\nsigma = 1.00\nmin_len = 128\n'
        "max_len = 131072",
        'distribution = "trace"\npath = "lengths.txt"',
    )
    with pytest.raises(ConfigError, match=r"lengths\.txt:2: expected a token count"):
        load_plan_config(path)
