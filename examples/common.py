"""Shared by the examples: pick a backend from the command line.

    python examples/quickstart.py                          # in-process Engine, embedded model
    python examples/quickstart.py --url http://127.0.0.1:30000   # a running lmprog-runtime server
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import lmprog as sgl  # noqa: E402


def parse_args(description: str, extra=None):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="server URL; default: start an in-process Engine on the embedded model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model-path", default=None, help="model for the in-process Engine")
    if extra:
        extra(parser)
    return parser.parse_args()


def make_backend(args):
    """A RuntimeEndpoint for --url, else an in-process Engine; also made the default backend."""
    if args.url:
        backend = sgl.RuntimeEndpoint(args.url, api_key=args.api_key)
    else:
        flags = {"model_path": args.model_path} if args.model_path else {}
        backend = sgl.Engine(**flags)
    sgl.set_default_backend(backend)
    return backend
