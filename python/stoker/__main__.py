import sys

from stoker.tools.cli import main

sys.exit(main())
