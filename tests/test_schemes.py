"""The scheme registry (issue 20): one object per norm.placement, with its paper and formula, shared
by every block that uses it (copies and pickles included); an unknown name is refused."""
import copy
import pickle
import re

import pytest
import torch
from torch import nn

from normlab.config import PLACEMENTS
from normlab.model.residual import ResidualBlock
from normlab.model.schemes import SCHEMES, Scheme, get_scheme


def test_every_placement_is_a_registered_scheme_with_its_paper_and_formula():
    assert PLACEMENTS == ("post", "pre", "deepnorm", "subln", "sandwich", "rezero", "resi_dual", "b2t", "reordered", "pre_scaled",
                          "mix", "hybrid", "hybrid_star", "ngpt")
    for name, scheme in SCHEMES.items():
        assert isinstance(scheme, Scheme) and scheme.name == name and get_scheme(name) is scheme
        assert scheme.paper and re.match(r"(x = |\(x, d\) -> )", type(scheme).__doc__ or ""), name
    with pytest.raises(ValueError, match=r"^placement='middle'; allowed values: post, pre, "):
        get_scheme("middle")


def test_a_copied_or_pickled_block_keeps_the_one_scheme():
    block = ResidualBlock(nn.Linear(4, 4), nn.LayerNorm(4), 4, "deepnorm", 0.0, alpha=2.0)
    for other in (copy.deepcopy(block), pickle.loads(pickle.dumps(block))):
        assert other.scheme is get_scheme("deepnorm") and other.placement == "deepnorm"
        x = torch.randn(2, 3, 4)
        torch.testing.assert_close(other(x), block(x))


@pytest.mark.parametrize("placement", ["pre", "subln", "deepnorm", "rezero", "resi_dual"])
def test_norm_out_belongs_to_sandwich_alone(placement):
    with pytest.raises(ValueError, match="sandwich"):
        ResidualBlock(nn.Linear(4, 4), nn.LayerNorm(4), 4, placement, 0.0, norm_out=nn.LayerNorm(4))
    with pytest.raises(ValueError, match="sandwich"):
        ResidualBlock(nn.Linear(4, 4), nn.LayerNorm(4), 4, "sandwich", 0.0)
