"""`python -m zerolab.bench`: zerolab's engines against torch's own, on the same model and data.

- runner.py: the timed rounds on every rank, the launch, the command line (its docstring says
  how every figure is obtained);
- config.py: what runs (the engines, their torch counterparts, the targets, the sizes);
- report.py: the ranks' results combined into a table, a verdict per target, a figure;
- profile.py: `--profile`, where a step's time goes (torch.profiler on rank 0).
"""

from zerolab.bench.config import BenchConfig
from zerolab.bench.runner import main, parse_args, run, under_torchrun

__all__ = ["BenchConfig", "main", "parse_args", "run", "under_torchrun"]
