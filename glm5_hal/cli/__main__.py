import sys

from glm5_hal.cli import main

sys.exit(main())
