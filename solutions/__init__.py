"""Solutions to the course's exercises: the same files as exercises/, complete.

The parts a learner writes sit between `# BEGIN SOLUTION` and `# END SOLUTION` lines;
`python -m zerolab.grade --make-exercises` turns each such block into a
`raise NotImplementedError("Exercise N.M: ...")` and writes exercises/. Edit solutions/, then
regenerate: a test fails when the two drift apart.
"""
