"""``python -m eaglepangu_jax.cli``: the ``eaglepangu`` command."""

import sys

from eaglepangu_jax.cli.app import main

sys.exit(main())
