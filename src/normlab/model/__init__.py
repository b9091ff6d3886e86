"""The Transformer model, built from a ModelConfig alone; imports neither Lightning nor Hydra.

Nothing is imported here eagerly: `normlab.config` imports the choice lists of the modules below
(NORMS from norms.py, PLACEMENTS from schemes/, ...), so importing a submodule must not
import config.py back through this package.
"""
