"""zerolab.widgets: the memory calculator's old name. It is zerolab.plots.calculator now.

Kept for one release, so that notes and notebooks written for the old name still run; importing
it warns, naming the new one. The names are the ones zerolab.widgets had, all still there.
"""

import warnings

from zerolab.plots.calculator import (
    CHECKPOINT_LABELS,
    CHECKPOINT_TEXT,
    GPU_MEMORY,
    OPTIMIZERS,
    PRECISION_LABELS,
    PRESETS,
    SEQ_LENS,
    START,
    WORLD_SIZES,
    Activations,
    Calculation,
    Calculator,
    activation_figure,
    calculate,
    calculator,
    calculator_static,
    figure,
    nearest_shape,
    summary,
    table_html,
)

# FutureWarning, not DeprecationWarning: Python shows it by default, in a notebook too.
warnings.warn("zerolab.widgets is deprecated and will be removed in the next release: import "
              "zerolab.plots.calculator instead (the same names)", FutureWarning, stacklevel=2)

__all__ = [
    "CHECKPOINT_LABELS",
    "CHECKPOINT_TEXT",
    "GPU_MEMORY",
    "OPTIMIZERS",
    "PRECISION_LABELS",
    "PRESETS",
    "SEQ_LENS",
    "START",
    "WORLD_SIZES",
    "Activations",
    "Calculation",
    "Calculator",
    "activation_figure",
    "calculate",
    "calculator",
    "calculator_static",
    "figure",
    "nearest_shape",
    "summary",
    "table_html",
]
