"""`python -m zerolab.grade [NAME ...] [--path FOLDER]`: grade the course's exercises.

Also `--make-exercises` (write exercises/ from solutions/) and `--check-exercises`.
Everything lives in the zerolab.grading package (the command line in zerolab.grading.cli);
this is the command line's entry point only.
"""

import sys

from zerolab.grading.cli import main

if __name__ == "__main__":
    sys.exit(main())
