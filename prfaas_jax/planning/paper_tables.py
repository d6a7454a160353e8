"""The paper's published numbers (arXiv 2604.15039: Tables 3, 5 and 6) and its Eqs. 1–2.

    Φ_kv(l) = S_kv(l) / T_prefill(l)                      (1)  `kv_gbps`
    B_out   ≈ (N / P) · Φ_kv(L_avg)                        (2)  `cluster_egress_gbps`

with S in bytes, T in s, Φ and B in Gbps (10⁹ bit/s). The tables use MiB (2²⁰ B) for S_kv and
"1K … 128K" for 1024·k tokens: 701.3 MiB · 8 · 2²⁰ / 1.84 s = 3.197 Gbps (Table 5 says 3.19).

`TABLE3_GBPS` is Table 3 (Φ_kv on 8×H200, SGLang v0.5.9) keyed by our preset names, `TABLE5` the
internal 1T model (our stand-in: the ``prfaas-1t`` preset), and `EGRESS_FIGURES` the §2.3 worked
examples with the inputs Eq. 2 needs (P = 8 GPUs per instance, as in the paper's Tables 3 and 5).
`TABLE6` is the case study of §4 (`Table6`: one `Table6Column` per deployment, PrfaaS-PD's
operating point and the §4.3–4.4 speedups), as printed: rounded to two or three digits, so the
tests compare it loosely (tests/planning/test_case_study.py; configs/plans/case-study-1t.toml
and docs/planning.md derive the inputs the paper leaves out).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
PAPER_LENGTHS = (1024, 8192, 32768, 131072)  # "1K, 8K, 32K, 128K"

# Table 3: Φ_kv in Gbps at PAPER_LENGTHS, one 8×H200 instance.
TABLE3_GBPS: dict[str, tuple[float, float, float, float]] = {
    "kimi-linear-48b": (1.19, 2.29, 3.87, 4.88),
    "mimo-v2-flash": (0.82, 2.85, 4.66, 4.71),
    "qwen3.5-397b": (4.13, 6.28, 8.25, 7.47),
    "ring-2.5-1t": (7.27, 4.47, 2.59, 1.46),
    "minimax-m2.5": (4.94, 32.87, 59.93, 47.82),
    "qwen3-235b": (4.12, 22.42, 33.35, 21.50),
}


@dataclass(frozen=True)
class Table5Row:
    length: int
    kv_mib: float  # S_kv
    prefill_s: float  # T_prefill
    kv_gbps: float  # Φ_kv


TABLE5_MODEL = "prfaas-1t"
TABLE5 = (
    Table5Row(1024, 190.8, 0.44, 3.61),
    Table5Row(8192, 308.9, 0.72, 3.59),
    Table5Row(32768, 701.3, 1.84, 3.19),
    Table5Row(131072, 2316.3, 7.40, 2.62),
)


@dataclass(frozen=True)
class EgressFigure:
    """One §2.3 figure: N GPUs in instances of P, each producing Φ_kv(model, length)."""

    label: str
    model: str
    length: int
    num_gpus: int
    gpus_per_instance: int
    paper_gbps: float
    upper_bound: bool = False  # the paper gives "< paper_gbps" rather than "≈ paper_gbps"

    def paper_kv_gbps(self) -> float:
        """The Table 3 Φ_kv this figure is built on."""
        return TABLE3_GBPS[self.model][PAPER_LENGTHS.index(self.length)]


EGRESS_FIGURES = (
    EgressFigure("MiniMax-M2.5, 512×H200, 32K", "minimax-m2.5", 32768, 512, 8, 3800.0),
    EgressFigure("Qwen3-235B, 512×H200, 32K", "qwen3-235b", 32768, 512, 8, 2100.0),
    EgressFigure("Ring-2.5-1T, 512×H200, 32K", "ring-2.5-1t", 32768, 512, 8, 170.0),
    EgressFigure("Ring-2.5-1T, 512×H200, 128K only", "ring-2.5-1t", 131072, 512, 8, 100.0, True),
    EgressFigure("Ring-2.5-1T, 10,000 GPUs, 128K", "ring-2.5-1t", 131072, 10000, 8, 1800.0),
)


@dataclass(frozen=True)
class Table6Column:
    """One deployment of Table 6. An instance count the deployment lacks is 0 and a stage it
    lacks None (the table's "—"); throughputs in req/s, TTFT in s."""

    num_prfaas: int
    num_pd_prefill: int
    num_pd_decode: int
    prfaas: float | None  # Θ_prfaas
    pd_prefill: float | None  # Θ_pd-p
    pd_decode: float  # Θ_pd-d
    lambda_max: float  # Λ_max, Eq. 6
    ttft_mean_s: float
    ttft_p90_s: float


@dataclass(frozen=True)
class Table6:
    """The case study (§4.3–4.4): three deployments of the internal 1T model, and PrfaaS-PD's
    routing and egress."""

    prfaas_pd: Table6Column
    homogeneous_pd: Table6Column
    naive_heterogeneous: Table6Column
    threshold: int  # PrfaaS-PD's t in tokens: "19.4K" is 19,400 (docs/planning.md)
    offload_fraction: float  # its p = P(L > t)
    mean_long_len: float  # its E[L | L > t], "≈ 44K"
    egress_gbps: float  # its PrfaaS egress, "≈ 13 Gbps"
    speedup_vs_homogeneous: float  # Λ_max ratio, "54 %" higher
    speedup_vs_naive: float  # "32 %" higher
    equal_cost_speedup_vs_homogeneous: float  # §4.4: "≈ 15 %" at equal GPU cost


TABLE6 = Table6(
    prfaas_pd=Table6Column(4, 3, 5, 1.61, 1.64, 3.91, 3.24, 2.22, 3.51),
    homogeneous_pd=Table6Column(0, 9, 3, None, 2.11, 2.35, 2.11, 4.44, 9.73),
    # Θ_prfaas is its Λ_max: everything is offloaded (p = 1) and decode does not bind.
    naive_heterogeneous=Table6Column(4, 0, 8, 2.45, None, 6.25, 2.45, 1.74, 3.51),
    threshold=19_400,
    offload_fraction=0.496,
    mean_long_len=44_000.0,
    egress_gbps=13.0,
    speedup_vs_homogeneous=1.54,
    speedup_vs_naive=1.32,
    equal_cost_speedup_vs_homogeneous=1.15,
)


def kv_gbps(kv_bytes: float, prefill_s: float) -> float:
    """Eq. 1: the rate at which one instance produces state, in Gbps."""
    if prefill_s <= 0:
        raise ValueError(f"prefill time must be positive, got {prefill_s}")
    return kv_bytes * 8 / prefill_s / 1e9


def cluster_egress_gbps(
    num_gpus: int, gpus_per_instance: int, kv_gbps_per_instance: float
) -> float:
    """Eq. 2: the egress a prefill cluster of ``num_gpus`` needs, in Gbps."""
    return num_gpus / gpus_per_instance * kv_gbps_per_instance


def relative_error(ours: float, paper: float) -> float:
    return ours / paper - 1.0
