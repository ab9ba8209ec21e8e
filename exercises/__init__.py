"""The course's exercises: stubs to complete, one file per notebook (01-07).

Each function's docstring states the task, the shapes and a hint. Check your work with
`from zerolab.grading import grade; grade("ex03")` in a notebook, or
`python -m zerolab.grade ex03` in a shell. To work on a copy instead (several learners side
by side): `cp -r exercises my_copy`, then `grade("ex03", path="my_copy")` or
`python -m zerolab.grade ex03 --path my_copy`.

Generated from solutions/ by `python -m zerolab.grade --make-exercises` (which overwrites the
files here: keep your work in a copy, or commit it first).
"""
