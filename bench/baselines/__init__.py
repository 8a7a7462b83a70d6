"""The systems lmprog is measured against: HF `transformers` generate, llama.cpp's server,
and lmprog itself with its radix cache off (a server flag, see `servers.py`)."""
