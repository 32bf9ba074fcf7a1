import sys

from nbpar.cli import main

sys.exit(main())
