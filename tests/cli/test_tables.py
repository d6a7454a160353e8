"""`prfaas_jax.tables` on literal rows: widths, alignment, the header rule, key-value lines."""

from __future__ import annotations

import pytest

from prfaas_jax.tables import key_value, table


def test_first_column_left_the_rest_right_by_default():
    text = table([("a", 1, "x"), ("bbb", 22, "yy")], headers=("name", "n", "tag"))
    assert text.splitlines() == [
        "name   n  tag",
        "-------------",
        "a      1    x",
        "bbb   22   yy",
    ]


def test_align_per_column_and_no_trailing_spaces():
    text = table([("1", "left", "r"), ("22", "l", "rr")], align="rlr")
    assert text.splitlines() == [
        " 1  left   r",
        "22  l     rr",
    ]
    assert table([("x", "")], align="ll") == "x"  # an empty last cell leaves no padding


def test_cells_are_rendered_with_str():
    assert table([(None, 1.5, True)]) == "None  1.5  True"


def test_key_value_pads_the_labels():
    assert key_value([("model", "tiny"), ("new tokens", "1,2,3")]).splitlines() == [
        "model       tiny",
        "new tokens  1,2,3",
    ]


def test_headers_alone_and_nothing_at_all():
    assert table([], headers=("a", "bb")) == "a  bb\n-----"
    assert table([]) == ""


@pytest.mark.parametrize(
    ("rows", "align"),
    [([("a", "b"), ("c",)], None), ([("a", "b")], "l"), ([("a", "b")], "lc")],
)
def test_ragged_rows_and_bad_align_are_refused(rows, align):
    with pytest.raises(ValueError):
        table(rows, align=align)
