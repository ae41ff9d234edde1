"""verl's `verl.plugins` entry point (pyproject.toml): verl imports this module in every process that
imports verl, at the end of `verl/__init__.py` (VERL_USE_EXTERNAL_PLUGINS unset or `auto`, or naming
`fastrlhf`), and logs a plugin's exception at debug level only, so this module never raises. With
FASTRLHF_PATCH naming verl it patches verl (fastrlhf_hook.activate); otherwise it imports nothing more."""

import fastrlhf_hook

fastrlhf_hook.activate("verl", via="verl.plugins")
