"""The directory ``cudnn-attention run`` puts first on ``PYTHONPATH`` (see :mod:`..launch`).

Only its ``sitecustomize.py`` matters, as a top-level module that Python's ``site`` imports at start-up; this
file makes the directory a package so that it ships with the others.
"""
