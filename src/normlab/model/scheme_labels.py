"""What a run's name says of its residual scheme (identity.norm_label), apart from the schemes'
torch code (schemes/) so that identity.py, pure functions of config values, imports no model.

Post- and pre-norm put any norm at a position (Vaswani et al. 2017; Wang et al. 2019): their label
names the norm type (post_ln, pre_scalenorm). Every other scheme is one paper's design around its
own norm (LayerNorm; none for ReZero): its name stands alone with that norm (deepnorm, rezero) and
names any other (subln_rmsnorm). A new scheme is of the second kind unless listed here.
"""
NAMED_WITH_NORM = ("post", "pre")
