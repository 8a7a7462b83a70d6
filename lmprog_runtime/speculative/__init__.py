"""Speculative decoding: draft sources behind one contract (base.py), the per-request
draft budget and grammar trimming (speculator.py), and verification (verify.py)."""
