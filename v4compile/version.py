"""The compiler's version (the artifact's manifest records it as `compiler_version`)."""

__version__ = "0.1.0"
