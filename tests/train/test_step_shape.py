"""The step's shape (train/step_shape.py): the uneven micro-batch split a step draws, by hand."""

from train.step_shape import StepShape


def test_sizes_of_an_uneven_split_and_none_when_even():
    assert StepShape(8, 3, 3, 32).sizes() == [3, 3, 2]  # ceil(8 / 3) = 3 micro-batches
    assert StepShape(512, 24, 22, 2048).sizes() == [24] * 6 + [23] * 16
    assert StepShape(8, 4, 2, 32).sizes() is None  # 4 divides 8: every micro-batch is full
    assert StepShape(8, 3, 5, 32).sizes() is None  # a driver's own accumulation: its sizes
    assert StepShape(4, 8, 1, 32).sizes() is None  # a micro-batch above the step


def test_rows_per_call():
    assert StepShape(8, 3, 3, 32).rows_per_call == 96
