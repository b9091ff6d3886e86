"""Train and score one model: `python train.py [overrides]`, or a sweep with `-m`.

Examples:
    python train.py                                   # the CPU default on the bundled de-en corpus
    python train.py norm=postnorm model.encoder_layers=6 seed=3
    python train.py -m norm=postnorm,prenorm model.encoder_layers=6,12
    python train.py --help                            # config groups and options
"""
import hydra
from omegaconf import DictConfig

import normlab.identity  # the resolvers conf/hydra names run folders with (nl.run_name, nl.study)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    normlab.identity.register_resolvers()  # a submitit worker unpickles main without running this file
    from normlab.failure import record_failure
    from normlab.train import run  # imported late so `--help` stays fast

    try:
        results = run(cfg)
    except Exception as err:  # results.json: status failed; a multirun goes on, a single run exits 1
        if record_failure(cfg, err):
            return None
        raise
    return results.get("valid_bleu")  # the value an Optuna sweeper maximises (None: Optuna marks the trial failed)


if __name__ == "__main__":
    main()
