"""lmprog's grammar engine: JSON Schema / regex -> value grammar -> pushdown matcher ->
token masks over the vocabulary trie (docs/constrained.md, "The cfg engine")."""
