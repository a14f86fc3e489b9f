import sys

from vigil_dev.cli import main

if __name__ == "__main__":
    sys.exit(main())
