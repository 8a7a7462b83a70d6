"""`python -m lmprog_runtime serve [...]` — same as the `lmprog-runtime` command."""

import sys

from lmprog_runtime.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
