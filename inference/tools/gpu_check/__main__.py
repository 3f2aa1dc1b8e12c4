"""`python -m inference.tools.gpu_check [ARGS]`: the device check, `wheels` or `install-wheels` (main in
__init__.py)."""
import sys

from . import main

sys.exit(main())
