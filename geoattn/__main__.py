"""`python -m geoattn ...` (and `torchrun -m geoattn train ...`)."""

from geoattn.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
