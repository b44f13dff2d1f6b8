# The one version of the five mori distributions (they are released together). Each pyproject.toml
# reads it through hatch's version source; each package's ``__version__`` reads its installed metadata.
__version__ = "0.1.0"
