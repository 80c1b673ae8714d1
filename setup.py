"""Build script. Metadata lives in pyproject.toml."""

from setuptools import setup

setup()
