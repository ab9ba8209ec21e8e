"""Where the grader finds solutions/ and exercises/, and its default limits."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SOLUTIONS_DIR = REPO / "solutions"
EXERCISES_DIR = REPO / "exercises"

DEFAULT_TIMEOUT = 30.0  # seconds one case may run on the ranks before it counts as hung
DEFAULT_WORLD_SIZES = (1, 2, 3)
GRACE = 2.0  # seconds a rank that raised waits for the others before ending the launch
STARTUP_ALLOWANCE = 120.0  # the launch's backstop timeout: this + timeout per exercise
