"""Train and score one model: `python train.py [overrides]`, or a sweep with `-m`.

Examples:
    python train.py                                   # the CPU default on the bundled de-en corpus
    python train.py norm=postnorm model.encoder_layers=6 seed=3
    python train.py -m norm=postnorm,prenorm model.encoder_layers=6,12
    python train.py --help                            # config groups and options

The same as `normlab-train` and `python -m normlab.commands.train` (src/normlab/commands/train.py).
"""
from normlab.commands.train import cli

if __name__ == "__main__":
    cli()
