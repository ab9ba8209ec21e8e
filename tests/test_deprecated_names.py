"""Old public names still work for one release, each warning with the name that replaced it:
`python -m zerolab.train --strategy` (now --engine) and `zerolab.widgets` (now
zerolab.plots.calculator). FutureWarning: Python shows it by default, to a command's user and in
a notebook alike."""

from __future__ import annotations

import importlib
import sys

import pytest

import zerolab.plots.calculator
from zerolab import train


def test_train_strategy_is_engine_with_a_warning_naming_it():
    with pytest.warns(FutureWarning, match=r"^--strategy is deprecated and will be removed in the "
                                           r"next release: use --engine zero2$"):
        config = train.parse_args(["--strategy", "zero2"])
    assert config.engine == "zero2"
    with pytest.warns(FutureWarning, match="use --engine ddp"):
        assert train.parse_args(["--strategy", "ddp", "--engine", "ddp"]).engine == "ddp"


def test_train_strategy_that_disagrees_with_engine_is_a_usage_error(capsys):
    with pytest.warns(FutureWarning), pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--strategy", "zero1", "--engine", "zero3"])
    assert exit_info.value.code == 2
    assert ("--strategy zero1 and --engine zero3 disagree: give --engine alone (--strategy is its "
            "old name)") in capsys.readouterr().err


def test_train_engine_alone_does_not_warn(recwarn):
    assert train.parse_args(["--engine", "zero1"]).engine == "zero1"
    assert train.parse_args([]).engine == train.TrainConfig().engine
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_zerolab_widgets_is_the_calculator_with_a_warning_naming_it(monkeypatch):
    monkeypatch.delitem(sys.modules, "zerolab.widgets", raising=False)  # imported afresh: warns
    with pytest.warns(FutureWarning, match=r"^zerolab\.widgets is deprecated and will be removed "
                                           r"in the next release: import zerolab\.plots\."
                                           r"calculator instead \(the same names\)$"):
        widgets = importlib.import_module("zerolab.widgets")
    assert {"calculate", "calculator", "calculator_static", "Calculation"} <= set(widgets.__all__)
    for name in widgets.__all__:
        assert getattr(widgets, name) is getattr(zerolab.plots.calculator, name), name
    calc = widgets.calculate("7B", world_size=8, stage="ZeRO-2")
    assert calc == zerolab.plots.calculator.calculate("7B", world_size=8, stage="ZeRO-2")
