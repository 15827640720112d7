"""Shim for tools that still call setup.py; the project is described in pyproject.toml."""

from setuptools import setup

setup()
