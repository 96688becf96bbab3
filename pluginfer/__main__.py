import sys

from pluginfer.cli import main

sys.exit(main())
