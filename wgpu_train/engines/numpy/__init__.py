"""The NumPy engine: the one place where the math of every op is written down, the oracle of every GPU result."""
