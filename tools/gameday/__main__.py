import sys

from tools.gameday.cli import main

sys.exit(main())
