import sys

from flatep.cli import main

sys.exit(main())
