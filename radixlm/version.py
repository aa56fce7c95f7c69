"""The package version, importable from every layer (the package root may not be imported)."""
__version__ = "0.1.0"
