"""bnn_pyro.utils.checks on pandas input: rows paired by label, columns converted by their numeric type, and
non-numeric columns named."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from bnn_pyro.utils.checks import check_data

FRAME = pd.DataFrame({"a": np.linspace(-1.0, 1.0, 6), "b": np.arange(6) % 2 == 0})
TARGET = pd.Series(np.linspace(0.0, 1.0, 6))


@pytest.mark.parametrize(
    "y",
    [
        pd.Series(TARGET.to_numpy(), index=TARGET.index[::-1]),  # the same labels in another order
        TARGET.iloc[1:].reset_index(drop=True).reindex(range(6)).fillna(0.0).set_axis(range(1, 7)),  # shifted
    ],
    ids=["reversed", "shifted"],
)
def test_pandas_x_and_y_with_other_row_labels_are_refused(y):
    """Rows are paired by position; a y whose labels differ from x's (another order, another mask) was paired
    with the wrong inputs silently."""
    with pytest.raises(
        ValueError,
        match=r"x and y are pandas objects with different row labels \(row 0: x has 0.*"
        r"y = y\.loc\[x\.index\]",
    ):
        check_data(FRAME, y)


def test_pandas_rows_with_the_same_labels_or_one_side_unlabelled_are_paired_by_position():
    subset = FRAME.iloc[2:]
    x, y = check_data(subset, TARGET.iloc[2:])  # filtered by the same mask: labels 2..5 on both
    assert torch.equal(y, torch.tensor(TARGET.to_numpy()[2:]))
    assert check_data(subset, TARGET.to_numpy()[2:])[1].shape == (4,)  # an array has no labels to compare


def test_a_frame_of_bool_and_float_columns_converts_to_numbers():
    """A bool column beside a float one made to_numpy() an object array: 'could not convert ndarray of dtype
    object'. The columns now convert in their common numeric type."""
    x, _ = check_data(FRAME, TARGET, float_dtype=torch.float32)
    assert x.dtype == torch.float32
    assert torch.equal(x[:, 1], torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]))


@pytest.mark.parametrize(
    "column, dtype",
    [(["u"] * 6, "(object|str)"), ([None] * 6, "object"), (pd.Categorical(["u", "v"] * 3), "category")],
    ids=["text", "none", "category"],
)
def test_non_numeric_columns_are_named(column, dtype):
    with pytest.raises(TypeError, match=rf"x: column\(s\) 'c' \({dtype}\) of the DataFrame are not numeric; encode"):
        check_data(FRAME.assign(c=column), TARGET)


def test_a_series_of_text_labels_is_named_as_such():
    with pytest.raises(TypeError, match=r"y: the Series' values \((object|str)\) are not numeric; .*\.cat\.codes"):
        check_data(FRAME, pd.Series(["yes", "no"] * 3))
