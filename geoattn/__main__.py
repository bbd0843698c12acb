"""`python -m geoattn ...` (and `torchrun -m geoattn train ...`)."""

from geoattn.cli import console

if __name__ == "__main__":
    console()
