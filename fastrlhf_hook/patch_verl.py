"""Importing this module patches verl, whatever FASTRLHF_PATCH says: the module to name in verl's own hooks,
`VERL_USE_EXTERNAL_MODULES=fastrlhf_hook.patch_verl` (imported by verl/__init__.py in every process) or
`actor_rollout_ref.model.external_lib=fastrlhf_hook.patch_verl` (imported where each worker builds its model
config). Logged as the switch logs (fastrlhf.integrations.switch.apply); never raises."""

try:
    from fastrlhf.integrations import switch
except Exception as e:  # noqa: BLE001  (verl would fail the worker on our ImportError)
    import sys

    print(f"fastrlhf: verl not patched: importing fastrlhf.integrations.switch failed: {type(e).__name__}: {e}",
          file=sys.stderr)
else:
    switch.apply("verl", via="external module")
