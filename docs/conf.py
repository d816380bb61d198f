"""Sphinx configuration: the guides (MyST Markdown) and the API reference (autodoc of the
Google-style docstrings). Built offline, every warning an error:

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sparsecomm_jax  # noqa: E402

project = "sparsecomm_jax"
author = "the sparsecomm_jax developers"
release = version = sparsecomm_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "lab/**"]  # the lab notebook is read on its own
myst_heading_anchors = 3

autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a NamedTuple's Attributes: fields of its entry, not objects
napoleon_attr_annotations = True

html_theme = "furo"
html_title = f"sparsecomm_jax {version}"


def _skip_field_aliases(app, what, name, obj, skip, options):
    """A NamedTuple's fields are documented by its Attributes section, not as the
    "Alias for field number N" properties Python makes."""
    doc = getattr(obj, "__doc__", None) or ""
    return True if doc.startswith("Alias for field number") else skip


def setup(app):
    app.connect("autodoc-skip-member", _skip_field_aliases)
