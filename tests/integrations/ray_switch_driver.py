"""Driver for test_switch_ray (run by it with the hooked interpreter and FASTRLHF_PATCH=all): one local
`ray.init(num_cpus=2)`; two actors import verl's and OpenRLHF's loss / log-prob modules as their trainers'
workers do, one inheriting the driver's switch (as the actors of verl's main_ppo and OpenRLHF's
train_ppo_ray inherit the environment of the process that called ray.init), one with FASTRLHF_PATCH=none
in its runtime_env. Prints one JSON line per actor."""

import json
import sys

import ray
import torch


@ray.remote(num_cpus=1)
class Probe:
    def run(self, logits):
        import peer_stubs

        peer_stubs.install()  # the peers are installed --no-deps: flash-attn, vllm, deepspeed stand-ins
        import openrlhf.models.utils as orl_utils
        import verl.trainer.ppo.core_algos as core_algos
        import verl.utils.torch_functional as verl_F
        from openrlhf.models.loss import PolicyLoss

        return {
            "fastrlhf_imported": "fastrlhf" in sys.modules,
            "modules": {"verl entropy_from_logits": verl_F.entropy_from_logits.__module__,
                        "verl agg_loss": core_algos.agg_loss.__module__,
                        "verl gae": core_algos.ADV_ESTIMATOR_REGISTRY["gae"].__module__,
                        "openrlhf compute_entropy": orl_utils.compute_entropy.__module__,
                        "openrlhf PolicyLoss.forward": PolicyLoss.forward.__module__},
            "verl_entropy": verl_F.entropy_from_logits(logits).tolist(),
            "openrlhf_entropy": orl_utils.compute_entropy(logits).tolist(),
        }


def main():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    on = Probe.remote()
    off = Probe.options(runtime_env={"env_vars": {"FASTRLHF_PATCH": "none"}}).remote()
    results = ray.get([on.run.remote(logits), off.run.remote(logits)])
    import fastrlhf

    expected = fastrlhf.entropy(logits).tolist()
    for name, result in zip(("on", "off"), results):
        result["equals_fastrlhf"] = result["verl_entropy"] == expected and result["openrlhf_entropy"] == expected
        print("RESULT", name, json.dumps(result), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
