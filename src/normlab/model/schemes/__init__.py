"""The residual schemes: one class per norm.placement, the ONLY code that knows the placements.

N is the norm (any norm type), F the sub-layer, drop the residual dropout (Vaswani et al. 5.4).
post      (Vaswani et al. 2017)       x = N(x·ω + drop(F(x)))      ω only with Admin, else 1
deepnorm  (Wang et al. 2022, DeepNet) x = N(α·x + drop(F(x)))      α per stack, a constant
pre       (Wang et al. 2019)          x = x + drop(F(N(x)))        + a final N per stack
subln     (Wang et al. 2022, Magneto) x = x + drop(F(N(x)))        + a final N; F has inner norms
sandwich  (Ding et al. 2021 CogView;  x = x + N_out(drop(F(N(x)))) + a final N
           Peri-LN, Kim et al. 2025)
rezero    (Bachlechner et al. 2020)   x = x + a·drop(F(x))         a a learned scalar, 0 at init;
                                                                    no norm (norm.type=none)
resi_dual (Xie et al. 2023)           (x, d) -> (N(x + f), d + f), f = drop(F(x)): a post-norm
                                      stream x and a dual stream d; the stack starts with d = x
                                      (its input) and outputs x + N_final(d).
b2t       (Takase et al. 2023)        x = N(x + drop(F(x))), but a layer's last block adds the layer's
                                      input: N(h + drop(F(h)) + x_layer); no final N
reordered (OLMo 2 2024; Swin v2 2022)  x = x + drop(N(F(x)))        + a final N per stack
pre_scaled (Sun et al. 2025, The      x = x + drop(F(N(x)/√ℓ))    in layer ℓ (1-based, per stack),
            Curse of Depth)                                         + a final N (unscaled)
mix       (Li et al. 2025, Mix-LN)    post in the first ⌊αL⌋ layers of each stack, pre in the
                                      others (α = norm.mix_ratio, 0.25), + a final N per stack
hybrid    (Zhuo et al. 2025,          attention: x = x + drop(Attn(x)), q, k, v each normalised inside
           HybridNorm)                (per head); FFN: x = N(x) + drop(F(N(x))); + a final N per stack
hybrid_star (Zhuo et al. 2025,        x = x + drop(F(N(x))) (pre-norm, QKV-norm kept) in the first layer
           HybridNorm*)               of each stack, hybrid in the others; + a final N per stack
ngpt      (Loshchilov et al. 2025,    h = Norm(h + α ⊙ (Norm(drop(F(h))) − h)), Norm = x/‖x‖; h₀ = Norm(embedding),
           nGPT)                      no final N, no norm layers (norm.type=none); unit-norm matrices after
                                      every step, q/k normalised per head (model/ngpt.py)

A scheme is a stateless object (one per name, `get_scheme`): the residual block (residual.py) keeps
the parameters under the names every checkpoint has (norm, omega, norm_out, alpha, scale) and hands
itself to its scheme's forward; the model asks the scheme how the stream enters and leaves a stack,
what norm ends it, which sub-layers get inner norms, how to scale the initial weights; DLCL asks
whether it is pre-like; config.py asks which combinations it refuses. Adding a scheme is one
subclass of base.Scheme (registered by its `name`) in a module of this package imported below (in
the order of the choice list), its conf/norm file and its tests.
"""
from normlab.model.schemes.base import MIX_RATIO, SCHEMES, Scheme, get_scheme
from normlab.model.schemes.classic import (DeepNorm, DualStreamInput, DualStreamOutput, Post, Pre, ReZero,
                                           ResiDual, Sandwich, SubLN, deepnorm_constants, subln_gains)
from normlab.model.schemes.recent import B2T, Hybrid, HybridStar, Mix, PreScaled, Reordered, post_norm_layers
from normlab.model.schemes.normalized import NGPT

PLACEMENTS = tuple(SCHEMES)  # config.py's norm.placement choices, in the order the modules register

__all__ = ["MIX_RATIO", "PLACEMENTS", "SCHEMES", "Scheme", "get_scheme", "Post", "Pre", "DeepNorm", "SubLN", "Sandwich", "ReZero",
           "ResiDual", "DualStreamInput", "DualStreamOutput", "deepnorm_constants", "subln_gains", "B2T",
           "Reordered", "PreScaled", "Mix", "Hybrid", "HybridStar", "post_norm_layers", "NGPT"]
