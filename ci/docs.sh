#!/usr/bin/env bash
# Builds the Sphinx docs into docs/_build/html; any warning fails the build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -n "${VIRTUAL_ENV:-}" ] || . .venv/bin/activate
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "docs: docs/_build/html/index.html"
