"""Sphinx configuration for the mori documentation (all five packages in one project)."""

project = "mori"
author = "the mori developers"
copyright = "2026, the mori developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = "mori"
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Optional heavy imports stay optional for the docs build too.
autodoc_mock_imports = ["torch", "triton", "mpi4py"]
nitpicky = False
suppress_warnings = ["myst.header"]
