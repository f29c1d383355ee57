"""NumPy reference path: the one place where the math of every op is written down."""
