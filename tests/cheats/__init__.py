"""Cheating and broken submissions for tests/test_grading.py.

``common.py`` holds the attacks that apply to any assignment; ``<assignment>.py`` (written
with the assignment) defines ``CASES``: a list of
``{"name", "cell": grade id of the answer cell to replace, "source": its new source,
"must_fail": set of test grade ids that must score 0}``; every other autograded test of
that submission must keep its points.
"""
