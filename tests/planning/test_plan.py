"""`prfaas plan` end to end: the bandwidth-bound regime, the JSON contract of the command, and
one-line config errors. The case study's numbers against Table 6 are in test_case_study.py."""

import json
import math
from pathlib import Path

import pytest

from prfaas_jax.cli import main
from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.paper_tables import TABLE6
from prfaas_jax.planning.plan_config import load_plan_config
from prfaas_jax.policy.length_distribution import EmpiricalLengths
from prfaas_jax.policy.search import search
from prfaas_jax.policy.throughput_model import gbps_to_mib_per_s

CASE_STUDY = Path(__file__).resolve().parents[2] / "configs" / "plans" / "case-study-1t.toml"


@pytest.fixture(scope="module")
def case_study():
    config = load_plan_config(CASE_STUDY)
    return config, search(config.model, config.baseline, thresholds=config.thresholds)


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
    paper = TABLE6.prfaas_pd
    assert out["threshold_tokens"] == 19400 == TABLE6.threshold
    assert (out["n_prfaas"], out["n_pd_prefill"], out["n_pd_decode"]) == (4, 3, 5)
    assert (out["n_prfaas"], out["n_pd_prefill"], out["n_pd_decode"]) == (
        paper.num_prfaas,
        paper.num_pd_prefill,
        paper.num_pd_decode,
    )
    assert out["lambda_max"] == pytest.approx(paper.lambda_max, rel=0.03)


def test_cli_bandwidth_flag(capsys):
    assert main(["plan", "--config", str(CASE_STUDY), "--json", "--bandwidth", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["egress_gbps"] <= 5.0 * (1 + 1e-9)
    assert out["threshold_tokens"] > 21_500


def test_cli_table_and_plot(capsys, tmp_path):
    # matplotlib is in the test extra: without it `--plot` exits 2 and this fails, not skips.
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
