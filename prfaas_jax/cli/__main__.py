"""``python -m prfaas_jax.cli``: the ``prfaas`` command without the installed script."""

import sys

from prfaas_jax.cli import main

sys.exit(main())
