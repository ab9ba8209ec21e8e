"""The course's exercises: stubs to complete (ex03_*.py: notebook 03's).

Each function's docstring states its contract (inputs, what it returns, the rules, what the
grader checks) and a short hint; the notebook teaches the rest, and
`from zerolab.grading import hint; hint("3.1")` gives one more hint at each call.
Check your work with `from zerolab.grading import grade; grade("ex03")` in a notebook, or
`python -m zerolab.grade ex03` in a shell. To work on a copy instead (several learners side
by side): `cp -r exercises my_copy`, then `grade("ex03", path="my_copy")` or
`python -m zerolab.grade ex03 --path my_copy`.

Generated from solutions/ by `python -m zerolab.grade --make-exercises` (which overwrites the
files here: keep your work in a copy, or commit it first).
"""
