import sys

from cellswarm.cli import main

sys.exit(main())
