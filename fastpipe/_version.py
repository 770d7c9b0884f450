"""The package version, read by pyproject.toml and fastpipe.__version__."""

__all__ = ["__version__"]

__version__ = "0.1.0"
