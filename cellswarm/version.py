"""The package's version: pyproject.toml reads it; nodes report it (doctor compares)."""

__version__ = "0.1.0"
