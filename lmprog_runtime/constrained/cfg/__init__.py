"""lmprog's grammar engine: JSON Schema / regex -> value grammar -> pushdown matcher ->
token masks over the vocabulary trie (docs/constrained.md, "The cfg engine")."""
from lmprog_runtime.constrained.cfg.compiled import install as _install

_install()  # (before any other module of the package is imported: compiled.py)
