"""``python -m sidecar.conformance`` = ``openengine-conformance``."""

from ._cli import main

if __name__ == "__main__":
    main()
