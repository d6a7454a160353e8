"""`prfaas kv --allocator paged`: what a request really holds in the engines' block pool, beside
the canonical formula — `PagedReport`, `paged_json` and `format_paged`.

The page rule and the counts come from engine/page_layout.py (computed by the command and
passed in as plain objects, so this module stays free of JAX): per length, the pages a request
of that many positions holds, their bytes, the ratio to ``state_nbytes`` and what a linear-state
checkpoint at every full block would add. JSON keys::

    {"block_size", "tokens_per_page", "page_bytes",
     "rows": [{"length", "formula_bytes", "pages", "paged_bytes", "paged_ratio",
               "checkpoint_bytes"}]}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prfaas_jax.planning.kv_report import format_length, mib
from prfaas_jax.tables import table


class PagedSizeLike(Protocol):
    length: int
    formula_bytes: int
    pages: int
    paged_bytes: int
    checkpoint_bytes: int


@dataclass(frozen=True)
class PagedReport:
    model: str
    block_size: int  # requested
    tokens_per_page: int  # used
    page_bytes: int
    rows: Sequence[PagedSizeLike]


def paged_json(report: PagedReport) -> dict[str, object]:
    return {
        "block_size": report.block_size,
        "tokens_per_page": report.tokens_per_page,
        "page_bytes": report.page_bytes,
        "rows": [
            {
                "length": row.length,
                "formula_bytes": row.formula_bytes,
                "pages": row.pages,
                "paged_bytes": row.paged_bytes,
                "paged_ratio": row.paged_bytes / row.formula_bytes,
                "checkpoint_bytes": row.checkpoint_bytes,
            }
            for row in report.rows
        ],
    }


def format_paged(report: PagedReport) -> str:
    header = ["length", "S_kv MiB", "pages", "paged MiB", "÷ S_kv", "+ckpt/block MiB"]
    rows = [
        [
            format_length(row.length),
            mib(row.formula_bytes),
            f"{row.pages:,}",
            mib(row.paged_bytes),
            f"{row.paged_bytes / row.formula_bytes:.3f}",
            mib(row.checkpoint_bytes),
        ]
        for row in report.rows
    ]
    raised = (
        f", raised to {report.tokens_per_page} tokens so a page holds a linear state"
        if report.tokens_per_page != report.block_size
        else ""
    )
    return "\n".join(
        [
            f"paged allocator: {report.model}, block size {report.block_size}{raised}; "
            f"page {report.page_bytes:,} B",
            "",
            table(rows, headers=header),
            "",
            "paged: pages one request of that many positions holds (a page per block of each",
            "MLA/GQA layer, a ring of pages per SWA layer, a page per linear state), × page size.",
            "+ckpt/block: a linear-state checkpoint at every full block on top (docs/kv.md).",
        ]
    )
