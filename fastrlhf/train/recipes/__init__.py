"""One training loop per stage: sft, rm, dpo, ppo (GAE and the critic-free estimators), distill, and the
pipeline that chains them. Each module exposes `main(argv)` for `fastrlhf <stage>`."""
