"""Where the grader finds solutions/ and exercises/, and its default limits."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SOLUTIONS_DIR = REPO / "solutions"
EXERCISES_DIR = REPO / "exercises"

DEFAULT_TIMEOUT = 30.0  # seconds one case (or one import) of a learner's file may run
DEFAULT_WORLD_SIZES = (1, 2, 3)
GRACE = 2.0  # seconds a rank that raised waits for the others before its process ends
STARTUP_ALLOWANCE = 120.0  # seconds the processes may take to start and run the references
OUTPUT_LIMIT = 1 << 20  # bytes a learner's process may print: past it, it is stopped
FILE_LIMIT = 64 << 20  # the largest file a learner's process may write (RLIMIT_FSIZE)
MEMORY_LIMIT = 6 << 30  # the address space a learner's process may map (RLIMIT_AS)
CPU_LIMIT = 300  # CPU seconds one case (or one import) may use (RLIMIT_CPU, set per case)
# Python's string hashing seed of rank 0, 1, 2 (PYTHONHASHSEED): different, as in processes
# started one by one (torchrun). Chosen so that the three iterate a set of a few parameter
# names (6.2's) in three different orders: a collective issued per name in set order mismatches.
HASH_SEEDS = (1, 2, 4)
