"""``python -m auraed.client.cli``: aer (which is ``auraed.aer``, the same command line)."""

from auraed.client.cli import main

# Guarded as auraed/aer.py is: guest-image/build imports every module to check the image.
if __name__ == "__main__":
    main()
