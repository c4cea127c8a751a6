"""Sphinx configuration: API reference (autodoc + napoleon) and Markdown guides (MyST)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # Document the checkout, installed or not.

import jmp_lite  # noqa: E402

project = "jmp_lite"
author = "jmp_lite authors"
copyright = "jmp_lite authors"
version = release = jmp_lite.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Google-style docstrings. Attributes as :ivar: fields, so that dataclass
# fields documented in the class docstring are not described twice.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "furo"
html_title = f"jmp_lite {release}"
