import sys

from decider_dev.gameday.cli import main

sys.exit(main())
