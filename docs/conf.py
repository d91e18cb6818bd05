"""Sphinx configuration of the API reference (built by tests/test_docs.py with -W)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

project = "pyro_subspace"
author = "pyro_subspace contributors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_mock_imports: list[str] = []
default_role = "py:obj"  # `Name` in the docstrings links to the object when Sphinx knows it
html_theme = "alabaster"
exclude_patterns = ["_build"]
suppress_warnings = ["ref.python"]  # `Name` refs that are ambiguous between modules
napoleon_use_ivar = True  # "Attributes:" as fields, not duplicates of the properties
