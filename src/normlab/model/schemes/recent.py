"""The schemes of 2023-2025: B2T, Mix-LN, LayerNorm Scaling, reordered norm, HybridNorm and HybridNorm*
(formulas in the package docstring; /work/shared/papers.md, "2023-2026 schemes"). The registration order is the
norm.placement choice order, after the classic ones."""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import torch
from torch import nn

from normlab.model.qk_norms import QKVNorm
from normlab.model.schemes.base import OWN_CROSS_LAYER, SCHEMES, Scheme
from normlab.model.schemes.classic import Post, Pre


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
    # its layer adds its own input past its sub-layers: a cross-layer connection DenseFormer neither
    # defines a combination with nor needs
    no_dwa = OWN_CROSS_LAYER

    def last_forward(self, block, x, layer_input, *args, **kwargs):
        out = block.sublayer(x, *args, **kwargs)
        return block.norm(block.dropout.add(x, out) + layer_input)


class Reordered(Scheme):
    """x = x + drop(N(F(x))), and a final N per stack: the norm moves from the sub-layer's input to
    its output, inside the residual branch (OLMo 2, OLMo et al. 2024; Swin Transformer v2's
    res-post-norm, Liu et al. 2022). As OLMo-core's ReorderedNormTransformerBlock:
    h = x + dropout(attention_norm(attention(x))). The stream itself is never normalised, so each
    stack ends with a final N, as OLMo 2 keeps its final norm before the output layer (OLMo-core's
    LM head norm); DLCL takes it in its pre-norm form (pre_like)."""
    name, paper, pre_like = "reordered", "OLMo et al. 2024, OLMo 2; Liu et al. 2022, Swin v2", True

    def forward(self, block, x, *args, **kwargs):
        return block.dropout.add(x, block.norm(block.sublayer(x, *args, **kwargs)))


class PreScaled(Pre):
    """x = x + drop(F(N(x)/√ℓ)) in layer ℓ (1-based, counted within its stack: encoder and decoder
    layers are separate depths), and a final N per stack, unscaled: pre-norm with LayerNorm Scaling
    (Sun et al. 2025, The Curse of Depth; OLMo-core's LayerNormScaledTransformerBlock, whose
    1/sqrt(block_idx + 1) multiplies every in-layer norm's output, not the model's final norm).
    Named `pre_scaled`, not after the paper: it is pre-norm with a scaled norm, and any norm type
    takes the scale (pre_scaled_rmsnorm). 1/√ℓ is a persistent buffer on each block (`ln_scale`),
    as OLMo-core's: a pruned model keeps the scale each layer trained with."""
    name, paper = "pre_scaled", "Sun et al. 2025, The Curse of Depth"

    def block_options(self, cfg, d, stack, layer):
        return {"ln_scale": 1.0 / math.sqrt(layer + 1)}

    def add_state(self, block, alpha, ln_scale=1.0, **state):
        block.register_buffer("ln_scale", torch.tensor(float(ln_scale)))

    def forward(self, block, x, *args, **kwargs):
        out = block.sublayer(block.norm(x) * block.ln_scale, *args, **kwargs)
        return block.dropout.add(x, out)


def post_norm_layers(mix_ratio: float, n_layers: int) -> int:
    """⌊αL⌋, Mix-LN's number of post-norm layers, exact for a decimal α (0.29 · 100 is 28.999...
    in floats, 29 here)."""
    return math.floor(Fraction(repr(mix_ratio)) * n_layers)


def _read_flag(block, incompatible_keys=None, *, name: str) -> None:
    # The block's choice as a Python bool `<name>_layer` (no device sync per forward), refreshed from
    # the buffer whenever a state dict is loaded: a checkpoint's layers keep the choice they trained with.
    setattr(block, f"{name}_layer", bool(getattr(block, name)))


def add_layer_flag(block, name: str, value: bool) -> None:
    """A per-layer choice of the scheme as a persistent bool buffer `name` (pruning and checkpoints
    keep it) and its Python copy `<name>_layer`, which the forward reads."""
    block.register_buffer(name, torch.tensor(bool(value)))
    block.register_load_state_dict_post_hook(functools.partial(_read_flag, name=name))
    _read_flag(block, name=name)


class Mix(Scheme):
    """x = N(x + drop(F(x))) in the first ⌊αL⌋ layers of each stack (post-norm), x = x + drop(F(N(x)))
    in the others (pre-norm), α = norm.mix_ratio (Li et al. 2025, Mix-LN; their default 0.25), and a
    final N per stack. The paper sets the post-norm layers by the ratio α; the authors' LLaMA code
    (NORM_TYPE=post_pre, the first POST_NUM layers post-LN; seen in nikitus20/mixln, a copy of the
    pre-release) takes the count: we follow the paper. The final N: that code keeps LLaMA's final
    RMSNorm (`model.norm`) whatever the layers, and the stack's last layers are pre-norm (α < 1), so
    its output is un-normalised; we keep it for every α, so the model's structure and checkpoint
    keys do not depend on ⌊αL⌋ (a pruned model, rebuilt with fewer layers, loads its own). Each
    block stores its choice in a persistent buffer (`post_norm`): pruning keeps it."""
    name, paper = "mix", "Li et al. 2025, Mix-LN"
    final_n = True  # for every α, as above
    mix_ratio = True
    no_dlcl = "DLCL has a post-norm and a pre-norm form, Mix-LN's layers are both; choose one"

    def block_options(self, cfg, d, stack, layer):
        return {"post_norm": layer < post_norm_layers(cfg.norm.mix_ratio, getattr(cfg, f"{stack}_layers"))}

    def add_state(self, block, alpha, post_norm=False, **state):
        add_layer_flag(block, "post_norm", post_norm)

    def forward(self, block, x, *args, **kwargs):
        return SCHEMES["post" if block.post_norm_layer else "pre"].forward(block, x, *args, **kwargs)


def _is_attention(block) -> bool:
    # HybridNorm's attention blocks: their sub-layer holds the QKV-norm (inner_norm below)
    return getattr(block.sublayer, "qkv_norm", None) is not None


class Hybrid(Scheme):
    """x = x + drop(Attn(x)) for attention sub-layers, with q, k and v each normalised inside,
    softmax(N(Q)N(K)ᵀ/√d_head)N(V), and no norm on their input; x = N(x) + drop(FFN(N(x))) for FFN
    sub-layers: the norm before the FFN, whose skip starts from the normalised stream; and a final N
    per stack (HybridNorm, Zhuo et al. 2025, arXiv 2503.04598). We follow the paper's Fig. 1(d) and the
    authors' code (BryceZhuo/HybridNorm, dense_model: attn_norm false, use_query/key/value_norm true,
    ffn_norm true with ffn_residual_after_norm true, OLMo's final ln_f): in a layer, h = N(x + Attn(x)),
    out = h + FFN(h). The paper's "Post-Norm in the FFN" is this norm between the attention's add and
    the FFN, not N(x + FFN(x)) after the FFN's add. The QKV norms are per head (QKVNorm in
    qk_norms.py, as the authors'), one of norm.type each for q, k and v, in self- and cross-attention
    alike (the paper's decoder-only model has no cross-attention: its keys and values, from the
    encoder, are normalised as a self-attention's). A decoder layer: x + SelfAttn, + CrossAttn, then N
    and the FFN. The stack's output h + FFN(h) is un-normalised, hence the final N. HybridNorm*, the
    paper's variant with a pre-norm first layer, is HybridStar below. An attention block's own norm
    is the identity: its sub-layer normalises its inputs."""
    name, paper = "hybrid", "Zhuo et al. 2025, HybridNorm"
    final_n = True  # h + FFN(h) leaves the stream un-normalised (OLMo's final ln_f)
    # DLCL's pre form normalises layer outputs, its post form their combination: HybridNorm
    # normalises inside the layer (before the FFN) and neither paper defines the combination.
    no_dlcl = "HybridNorm's norm sits inside the layer, before the FFN, DLCL's at the layers' outputs; choose one"

    def add_state(self, block, alpha, **state):
        if _is_attention(block):
            block.norm = nn.Identity()  # an attention: N(x) = x, its q, k and v are normalised inside

    def forward(self, block, x, *args, **kwargs):
        h = block.norm(x)
        return block.dropout.add(h, block.sublayer(h, *args, **kwargs))

    def inner_norm(self, norm_cfg, d, kind, bias=True):
        return None if kind == "ffn" else QKVNorm(norm_cfg, d, bias)

    def model_refusal(self, cfg):
        if cfg.qk_norm != "none":
            return ("model.qk_norm", f"{cfg.qk_norm} with norm.placement={self.name}: HybridNorm's QKV-norm already "
                    "normalises q and k in every attention; leave model.qk_norm=none")
        for key in ("k_norm", "v_norm"):
            if getattr(cfg, key):
                return (f"model.{key}", f"true with norm.placement={self.name}: HybridNorm's QKV-norm already "
                        f"normalises k and v in every attention; leave model.{key}=false")
        return super().model_refusal(cfg)


def _drop_unsaved_input_norm(block, state_dict, prefix, *args) -> None:
    # Loading a pruned HybridNorm* model whose stack lost its first layer: rebuilt from its ModelConfig,
    # the stack's new first layer has the pre-norm attention input norm, but the saved block is a
    # later HybridNorm layer without one (pre_norm false). It is removed before the weights load, so
    # the model is the one that was pruned (strict load). The opposite cannot arise: pruning keeps the
    # order, so a kept first layer stays first.
    saved = state_dict.get(prefix + "pre_norm")
    if saved is not None and not bool(saved) and _is_attention(block):
        block.norm = nn.Identity()


class HybridStar(Hybrid):
    """x = x + drop(F(N(x))) for every sub-layer of the first layer of each stack (pre-norm, the
    attention's q, k and v still normalised inside it), HybridNorm (above) in the others, and a
    final N per stack: HybridNorm* (Zhuo et al. 2025, arXiv 2503.04598), the paper's variant that
    treats the first block specially. Defined by the authors' code (BryceZhuo/HybridNorm, README:
    HybridNorm's config plus norm_pos_special_config "{0: {'attn_norm': True, 'ffn_residual':
    False}}"; dense_model/olmo/model.py, OLMoSequentialBlock): in block 0, attn_norm = True puts a
    norm on the attention's input with the skip from the un-normalised x (attn_residual stays
    false), h = x + Attn_QKV(N(x)); ffn_residual = False takes the FFN's skip from before its norm,
    out = h + FFN(N(h)). use_query/key/value_norm are model-wide, not per block, so the first
    block's attention keeps its QKV-norm. The paper's §3 text was not readable here (only its
    abstract); we follow the code. The paper's model is decoder-only; here the first layer of each
    stack is pre-norm (layers counted per stack, as Mix-LN and LayerNorm Scaling do), its self- and
    cross-attention alike. Each block stores its choice in a persistent buffer (`pre_norm`), so a
    pruned model keeps the layers it trained; only first-layer attention blocks have an input norm,
    so every parameter trains (DDP)."""
    name, paper = "hybrid_star", "Zhuo et al. 2025, HybridNorm*"

    def block_options(self, cfg, d, stack, layer):
        return {"pre_norm": layer == 0}

    def add_state(self, block, alpha, pre_norm=False, **state):
        add_layer_flag(block, "pre_norm", pre_norm)
        if not pre_norm:
            super().add_state(block, alpha)
        block.register_load_state_dict_pre_hook(_drop_unsaved_input_norm)

    def forward(self, block, x, *args, **kwargs):
        if block.pre_norm_layer:
            return SCHEMES["pre"].forward(block, x, *args, **kwargs)
        return super().forward(block, x, *args, **kwargs)
