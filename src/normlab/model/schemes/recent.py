"""The schemes of 2023-2025: B2T, Mix-LN, LayerNorm Scaling, reordered norm (formulas in the package
docstring; /work/shared/papers.md, "2023-2026 schemes"). The registration order is the
norm.placement choice order, after the classic ones."""
from __future__ import annotations

from normlab.model.schemes.classic import Post


class B2T(Post):
    """x = N(h + drop(F(h)) + x_layer) in a layer's last block, x = N(x + drop(F(x))) in the others:
    post-norm whose last norm also receives the layer's input x_layer (the bottom-to-top
    connection). Encoder: h = N(x_layer + drop(F_attn(x_layer))); decoder: h after self- and
    cross-attention. We follow the authors' code (takase/b2t_connection,
    fairseq/modules/transformer_layer.py, `residual_bottom_to_top`): `residual_bottom = x` at the
    layer's start, then x = residual + dropout(fc2(...)), x = residual_bottom + x, final_layer_norm(x):
    the layer input is added after the dropout and the FFN's residual, before the last LN, as here.
    That code also multiplies every non-LayerNorm weight of a B2T layer by L^(-1/2) at construction
    (`rescaling_init`, "rescaling parameters for deep transformers"); the paper's connection is the
    formula above, which we follow: the initialisation stays model.init."""
    name, paper, admin = "b2t", "Takase et al. 2023, B2T connection", False
    # DLCL feeds a layer a learned mix of all earlier outputs and B2T skips the layer's own input
    # over its sub-layers: two answers to post-norm's vanishing gradient (Wang et al. 2019; Takase
    # et al. 2023) whose combination neither paper defines.
    no_dlcl = "B2T's bottom-to-top skip and DLCL are two different cross-layer connections; choose one"

    def last_forward(self, block, x, layer_input, *args, **kwargs):
        out = block.sublayer(x, *args, **kwargs)
        return block.norm(block.dropout.add(x, out) + layer_input)
