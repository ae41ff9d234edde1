"""`fastrlhf sft|rm|dpo|ppo|distill|pipeline|bench|estimate`.

Each subcommand lives in its own module, which exposes `main(argv: list[str]) -> int`;
this file only dispatches, so `fastrlhf --help` stays fast (no model code imported).
"""

from __future__ import annotations

import importlib
import sys
from typing import NoReturn

COMMANDS = {
    "sft": ("fastrlhf.train.recipes.sft", "supervised fine-tuning on prompt/response pairs"),
    "rm": ("fastrlhf.train.recipes.rm", "Bradley-Terry reward model on (prompt, chosen, rejected)"),
    "dpo": ("fastrlhf.train.recipes.dpo", "direct preference optimisation on (prompt, chosen, rejected) pairs"),
    "ppo": ("fastrlhf.train.recipes.ppo",
            "PPO: actor-critic with GAE, or critic-free (GRPO, Dr. GRPO, RLOO, REINFORCE++)"),
    "distill": ("fastrlhf.train.recipes.distill", "distil a teacher into a smaller student (offline or on-policy; "
                "forward KL, reverse KL or generalized JSD)"),
    "pipeline": ("fastrlhf.train.recipes.pipeline", "SFT -> RM -> PPO, SFT -> DPO with --algo dpo, or PPO then "
                 "distillation into a smaller student with --algo distill (the embedded default with no arguments)"),
    "bench": ("fastrlhf.bench", "roofline benchmark of every kernel against PyTorch and the peers"),
    "estimate": ("fastrlhf.estimate", "memory / FLOPs / time / cost of each RLHF stage and PPO phase"),
}


def _usage() -> str:
    lines = ["usage: fastrlhf COMMAND [options]   (fastrlhf COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from fastrlhf import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"fastrlhf: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


def run() -> NoReturn:
    """The `fastrlhf` command and `python -m fastrlhf`: `main()`, then the process's end. A stage
    under torchrun ends through `distributed.exit_process` (no interpreter teardown for gloo's threads
    to abort in); a command that never imported it (help, estimate) exits as usual."""
    code = main()
    distributed = sys.modules.get("fastrlhf.train.distributed")
    if distributed is not None:
        distributed.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
