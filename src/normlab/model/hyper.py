"""Hyper-connections: n residual streams in place of the one residual stream (model.residual).

add    (default) x ← x + drop(F(N(x))): the residual as the placement computes it, one stream.
hyper  (Zhu et al. 2024, arXiv 2409.19606, Hyper-Connections). Each token carries n streams
       H ∈ R^{n×d}; a residual block reads h = α_mᵀH (width connection) and writes
       H ← A_rᵀH + β·drop(F(N(h))) (depth connection), F with its own norm as pre-norm has it.
       Static: learned α_m ∈ R^n, A_r ∈ R^{n×n}, β ∈ R^n, initialised as the paper's eq. (14):
       α_m = e_{k mod n} (k the block's index in its stack), A_r = I, β = 1, so n copies of the
       embedding stay n copies of pre-LN's stream (bit for bit: the one-hot and identity products
       are exact). Dynamic (model.residual_mixing=dynamic, the paper's DHC): with H̄ = N'(H) (a norm of
       the model's norm type per stream and block, the paper's LayerNorm), per token
       α_m + s_α·tanh(H̄W_m), A_r + s_α·tanh(H̄W_r), β + s_β·tanh(H̄W_β), W = 0 and s = 0.01 at init
       as the paper's Algorithm (Appendix J; lucidrains/hyper-connections too): with W = 0 the
       offsets are 0 at init whatever s is, and s = 0 would leave both W and s without gradient.
mhc    (Xie et al. 2025, DeepSeek-AI, arXiv 2512.24880, mHC: Manifold-Constrained Hyper-Connections):
       H ← H_res·H + H_postᵀ·drop(F(N(H_pre·H))), H_pre = σ(H̃_pre), H_post = 2σ(H̃_post),
       H_res = Sinkhorn-Knopp(exp(H̃_res)), a doubly-stochastic matrix: it conserves the streams'
       mean and its norm is at most 1, so products of them across depth cannot amplify the
       signal (the paper's argument against HC's instability at scale). Static:
       H̃ = b (learned); dynamic (the paper's): H̃ = a·(x̃φ) + b with x̃ = RMSNorm of the n streams
       flattened to one n·d vector per token, φ = 0 and a = 0.01 at init (as HC above). The paper
       gives no init for b (none found in what we could read of it), so ours is HC's eq. (14) as
       near as mHC's maps reach it: with L = MHC_OFF_LOGIT = −8, b_res = 0 on the diagonal and L off
       it (FFTYYY/mhc-lite, the mHC-lite paper's code, hyper_conn/mhc.py: init_alpha1; and
       tokenbender/mHC-manifold-constrained-hyper-connections, hyper_connections_mhc.py: init_h_res),
       so H_res = Sinkhorn(exp b_res) ≈ I (diagonal 1/(1 + (n−1)e^L) ≈ 0.999, else e^L times that);
       H_pre = that matrix's row k mod n (k the block's index in its stack: block k reads stream
       k mod n, as those two and lucidrains/hyper-connections start H_pre), i.e. b_pre = −L − log(n−1)
       at k mod n and L − log(1 + (n−2)e^L) elsewhere, so Σσ(b_pre) = 1; b_post = 0 (2σ = 1, HC's
       β = 1; mhc-lite starts it at ±1 and lucidrains at 2σ(1) for every stream, neither of which
       keeps the next property). So the block is pre-LN's at init up to rounding (the read weights
       sum to 1, H_res maps n equal streams to themselves, each stream gets the branch once), and,
       unlike the uniform init (b_pre = −log(n−1), b_res = 0) this replaced, it is not symmetric
       under permuting the streams: the uniform one gave every stream the same gradient, so the n
       streams stayed equal copies through training (tests/test_hyper.py). Sinkhorn:
       SINKHORN_ITERS = 20 alternate row and column normalisations, the paper's t_max = 20
       (lucidrains' default too): columns sum to 1 after the last step, rows to within 1e-3 for
       logits of spread 1 around 0, but near the identity (our init) they converge slowly, the rate
       set by the off-diagonal mass: ~5e-3 off for diagonal logits moved by N(0, 0.5²), ~2e-2 for
       N(0, 1) (exact at init, whose matrix is symmetric; tests/test_hyper.py); a fixed count keeps
       the forward deterministic and cheap (n² per token and iteration).
       Why L = −8 and not a milder L (a review: e^−8 starts the mixing saturated, and the streams part
       slowly, spread 1.2e-3 after 30 steps against HC's 2.7e-2). Measured on deep_recent's mhc arm
       (`python train.py +arm=mhc model.d_model=64 model.encoder_ffn=256 model.decoder_ffn=256
       model.encoder_layers=12 model.decoder_layers=12 trainer.max_steps=150
       trainer.val_check_interval=150 eval.valid_bleu=false eval.test=false logger=csv seed=1`, the
       bundled corpus, MHC_OFF_LOGIT set to −8, −4, −2; 150 steps, not 300: four runs beside a study
       on 2 cores took ~15-22 s a step). Training loss, mean of the 20 steps to step 50 / 100 / 150:
       −8: 7.7475 / 6.3329 / 5.8953; −4: 7.7475 / 6.3319 / 5.8919; −2: 7.7474 / 6.3314 / 5.8910;
       validation loss at 150: 5.8409, 5.8379, 5.8375. Seed 2 at −8: 7.8568 / 6.3627 / 5.9558,
       valid 5.8674: the seeds differ by 0.03-0.11 (valid 0.027), the inits by at most 0.004, the
       same sign at every step but ten times below the seed noise. No surprise at init: n equal
       copies stay equal under any doubly-stochastic H_res and any read weights summing to 1, so L
       changes nothing but second-order terms until the streams part. And a milder L parts them
       LESS: the stream spread ‖H − H̄‖/(√n‖H̄‖) after the 12 encoder layers at step 150 (64
       validation sentences) was 3.6e-3 at −8 (7.3e-3 with seed 2), 1.7e-3 at −4, 9.2e-5 at −2,
       as more off-diagonal mass averages the streams. So −8 stays.

The stack expands its embedding into n copies (StreamExpand, the paper's H⁰) and sums the streams
(StreamReduce, the paper's "sum the last hyper hidden matrix row-wise"; lucidrains and
x-transformers' `num_residual_streams` sum too) before its final norm: the encoder's output, which
cross-attention reads, is one (B, S, d) tensor. The streams travel as one (n, B, T, d) tensor
(as ResiDual's two), so LayerDrop (a skipped layer passes them through unchanged), pruning
(the kept blocks keep their own mixing parameters) and the KV cache (per position) treat them as
one value. Only with placements whose block is pre-norm's, x + drop(F(N(x))) (pre, subln):
hyper-connections generalise that residual, the other placements put a norm on the stream or the
branch output, where the papers define none; DLCL is another learned cross-layer mixing.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from normlab.model.norms import RMSNorm, build_norm, widened

RESIDUALS = ("add", "hyper", "mhc")  # model.residual
MIXINGS = ("static", "dynamic")  # model.residual_mixing
STREAMS = 4  # model.residual_streams' default: the paper's main setting (n = 4, "HC×4")
SINKHORN_ITERS = 20  # mHC's t_max
DYNAMIC_SCALE = 0.01  # s_α, s_β (HC) and a (mHC) at init
MHC_OFF_LOGIT = -8.0  # mHC's b_res off the diagonal at init (mhc-lite, tokenbender; −4, −2 measured: module docstring)


def refusal(cfg) -> tuple[str, str] | None:
    """(key, what) for config.ConfigError when cfg (a ModelConfig) combines residual with what it
    cannot take, or None."""
    from normlab.model.schemes import Pre, get_scheme

    if cfg.residual == "add":
        for key, default in (("residual_streams", STREAMS), ("residual_mixing", "static")):
            if getattr(cfg, key) != default:  # a no-op setting would rename the run
                return (f"model.{key}", f"{getattr(cfg, key)} with model.residual=add: only hyper and mhc read it; "
                        f"leave it at {default}")
        return None
    scheme = get_scheme(cfg.norm.placement)
    if type(scheme).forward is not Pre.forward:
        return ("model.residual", f"{cfg.residual} with norm.placement={scheme.name}: hyper-connections replace "
                "pre-norm's x + F(N(x)) (Zhu et al. 2024); use norm.placement=pre or subln")
    if cfg.layer_aggregation != "none":
        return ("model.residual", f"{cfg.residual} with model.layer_aggregation={cfg.layer_aggregation}: both "
                "learn how layers mix across depth; choose one")
    return None


class StreamExpand(nn.Module):
    # H⁰ = n copies of the embedding: (B, T, d) -> (n, B, T, d), a view (no copy: blocks never write in place).
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(self.n, *x.shape)

    def extra_repr(self) -> str:
        return f"streams={self.n}"


class StreamReduce(nn.Module):
    # The sum over the streams (Zhu et al. 2024), before the stack's final norm: (n, B, T, d) -> (B, T, d).
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(0)


def stream_ends(cfg, scheme_input: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """A stack's (stream_in, stream_out): the scheme's input and no reduction for residual=add."""
    if cfg.residual == "add":
        return scheme_input, None
    return StreamExpand(cfg.residual_streams), StreamReduce()


class _Connection(nn.Module):
    """A residual block's forward over n streams, given its weights (the subclasses'): read the
    block's input from the streams, mix the streams, write the branch into them. The read and
    mix weights are applied together (the paper's (n+1)-column HC matrix, lucidrains' alpha):
    static weights have no token dims and make it one matmul; dynamic ones are per token (B, T),
    n multiply-adds over the source streams."""

    def weights(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """read (n[, B, T]), mix (source n, target n[, B, T]), write (n[, B, T])."""
        raise NotImplementedError

    def forward(self, block: nn.Module, h: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # The mixing runs in the streams' dtype: under mixed precision autocast would run these
        # matmuls in bf16 and round the residual streams at every block, which pre-norm's residual
        # add (fp32 stream + bf16 branch) never does. The sub-layer runs under autocast as always.
        with torch.autocast(h.device.type, enabled=False):
            read, mix, write = self.weights(h)  # h: (n, B, T, d)
            both = torch.cat((read[:, None], mix), dim=1)  # (source n, 1 + n[, B, T])
            if both.dim() == 2:
                y = torch.tensordot(both, h, dims=([0], [0]))  # (1 + n, B, T, d)
                write = write[:, None, None, None]
            else:  # per token: Σ_source weight·stream, one fused multiply-add per source stream (einsum
                # would make it a bmm over B·T tiny matrices, which CPU kernels loop over: slower,
                # benchmarks/README.md "Hyper-connections")
                y = both[0, :, :, :, None] * h[0]
                for i in range(1, both.shape[0]):
                    y = torch.addcmul(y, both[i, :, :, :, None], h[i])
                write = write[..., None]
            # the block's input (B, T, d), a copy: its norm keeps it for the backward, and a view
            # would keep all of y; the mixed streams (n, B, T, d)
            x, skip = y[0].clone(), y[1:]
        out = block.dropout(block.sublayer(block.norm(x), *args, **kwargs))  # pre-norm's branch
        return torch.addcmul(skip, write, out)  # skip + write·out in one pass (exact at write = 1)


class HyperConnection(_Connection):
    """Zhu et al. 2024: read α_m, mix A_r, write β; H ← A_rᵀH + β·drop(F(N(α_mᵀH)))."""

    def __init__(self, n: int, d: int, index: int, dynamic: bool, norm_cfg, bias: bool = True):
        super().__init__()
        alpha = torch.zeros(n)
        alpha[index % n] = 1.0  # e_{k mod n}: block k reads stream k mod n
        self.alpha, self.mix, self.beta = nn.Parameter(alpha), nn.Parameter(torch.eye(n)), nn.Parameter(torch.ones(n))
        self.dynamic = dynamic
        if dynamic:
            self.norm = build_norm(norm_cfg, d, bias)  # bias: model.bias
            self.w = nn.Parameter(torch.zeros(d, n + 2))  # columns: W_m, W_β, W_r (n of them)
            self.scale = nn.Parameter(torch.full((2,), DYNAMIC_SCALE))  # s_α, s_β

    def weights(self, h):
        if not self.dynamic:
            return self.alpha, self.mix, self.beta
        t = torch.tanh(self.norm(h) @ self.w)  # (n, B, T, n + 2): row i of H̄ gives row i's offsets
        s_a, s_b = self.scale[0], self.scale[1]
        alpha = self.alpha[:, None, None] + s_a * t[..., 0]
        beta = self.beta[:, None, None] + s_b * t[..., 1]
        mix = self.mix[:, :, None, None] + s_a * t[..., 2:].permute(0, 3, 1, 2)  # (source, target, B, T)
        return alpha, mix, beta

    def extra_repr(self) -> str:
        return f"streams={self.alpha.numel()}, dynamic={self.dynamic}"


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp with a hand-written backward: the same gradient as autograd through the
    iterations (tests/test_hyper.py). Autograd keeps every normalisation's input and divisor, 40
    (n, n, B, T) tensors and 40 smaller ones per block; this keeps only the logits, runs the
    forward in place, and in the backward recomputes the iterates (the paper's kernels recompute
    theirs in the backward too: Xie et al. 2025, §4.3.2 "Recomputing") and applies the one rule a
    normalisation y = x / Σ_a x has: dx = (g − Σ_a g·y) / Σ_a x. Its backward holds the 40
    iterates of one block at a time, while it runs. What it saves in a training step, with the
    layout and the mixing: benchmarks/README.md, "Hyper-connections"."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iters = iters
        return _sinkhorn_iterates(logits, iters)[0]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (logits,) = ctx.saved_tensors
        start, ys, sums = _sinkhorn_iterates(logits, ctx.iters, keep=True)
        for k in reversed(range(len(ys))):  # normalisation k is over dim 1 (rows) for even k, dim 0 for odd
            g = (g - (g * ys[k]).sum(dim=1 - k % 2, keepdim=True)) / sums[k]
        return g * start, None  # through exp (the subtracted max: a normalisation ignores a common factor)


def _sinkhorn_iterates(logits: torch.Tensor, iters: int, keep: bool = False):
    """Without keep: (the result, [], []), computed in place. With keep: (exp(logits − max), every
    normalisation's output, every normalisation's divisor), for the backward."""
    start = torch.exp(logits - logits.amax(dim=(0, 1), keepdim=True))  # the max out: no overflow
    m, ys, sums = start, [], []  # without keep, start is overwritten: nothing else holds it
    for _ in range(iters):  # a fixed count (see the module docstring); n² work per token
        for dim in (1, 0):  # rows, then columns
            s = m.sum(dim=dim, keepdim=True)
            if keep:
                m = m / s
                ys.append(m)
                sums.append(s)
            else:
                m.div_(s)
    return (start, ys, sums) if keep else (m, ys, sums)


def sinkhorn(logits: torch.Tensor, iters: int = SINKHORN_ITERS) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(logits) over the first two dims (rows, columns): a doubly-stochastic
    matrix (columns sum to 1 up to rounding after the last step, rows to within its error)."""
    if iters < 1:  # no normalisation: exp(logits − max), whose max the backward takes as a constant
        raise ValueError(f"sinkhorn: iters={iters}; must be at least 1")
    return _Sinkhorn.apply(logits, iters)


def mhc_init(n: int, index: int, off: float = MHC_OFF_LOGIT) -> tuple[torch.Tensor, torch.Tensor]:
    """mHC's b_pre (n) and b_res (n, n) at init for the block `index` of its stack (module docstring):
    b_res = 0 on the diagonal, `off` elsewhere (Sinkhorn(exp b_res) ≈ I); σ(b_pre) = that matrix's
    row index mod n, so the read weights sum to 1 and favour stream index mod n."""
    b_res = torch.full((n, n), off).fill_diagonal_(0.0)
    if n == 1:  # one stream: σ(10) ≈ 1, H_res = 1
        return torch.full((1,), 10.0), b_res
    # σ(b) = p ⇔ b = log p − log(1 − p); p_k = 1/(1 + (n−1)e^off), p_other = e^off·p_k
    b_pre = torch.full((n,), off - math.log1p((n - 2) * math.exp(off)))
    b_pre[index % n] = -off - math.log(n - 1)
    return b_pre, b_res


class ManifoldHyperConnection(_Connection):
    """Xie et al. 2025: H ← H_res·H + H_postᵀ·drop(F(N(H_pre·H))), H_res doubly stochastic."""

    def __init__(self, n: int, d: int, index: int, dynamic: bool, eps: float):
        super().__init__()
        self.n, self.dynamic = n, dynamic
        self.b_pre, self.b_res = (nn.Parameter(b) for b in mhc_init(n, index))
        self.b_post = nn.Parameter(torch.zeros(n))  # 2σ = 1: every stream gets the branch once
        if dynamic:
            self.norm = RMSNorm(n * d, eps)  # over the flattened streams, as the paper (applied in weights)
            self.phi = nn.Parameter(torch.zeros(n * d, 2 * n + n * n))  # φ_pre, φ_post, φ_res
            self.scale = nn.Parameter(torch.full((3,), DYNAMIC_SCALE))  # α_pre, α_post, α_res

    def weights(self, h):
        n = self.n
        # In fp32 for fp16 / bf16 streams and weights (precision=16-true, bf16-true), rounded once
        # to H's dtype at the end, as RMSNorm (norms.widened): in fp16 the dynamic RMS's H² overflows
        # from |H| = 256 on, and rsqrt(inf) = 0 dropped the dynamic term (tests/test_norm_precision.py).
        pre, post, res = widened(self.b_pre), widened(self.b_post), widened(self.b_res)
        if self.dynamic:
            # RMSNorm(vec H)·φ = rsqrt(mean(H²) + ε)·(vec H)·(diag(g)·φ): the division after the
            # matmul, as the paper's kernels reorder it; here it saves flattening H (a copy of the
            # streams kept for the backward): a bmm over the streams, summed, reads H in place.
            w = widened(h)
            gain = widened(self.norm.weight)[:, None]
            phi = (gain * widened(self.phi)).view(n, -1, self.phi.shape[1])  # (n, d, k)
            # φᵀ·Hᵀ, tokens last: every weight below is contiguous over (B, T), the layout in which
            # Sinkhorn's row and column sums add whole vectors (tokens first, its sums ran over
            # the innermost n: slower, benchmarks/README.md "Hyper-connections")
            z = torch.bmm(phi.transpose(1, 2), w.flatten(1, 2).transpose(1, 2)).sum(0)  # (2n + n², B·T)
            z = (z * torch.rsqrt(w.pow(2).mean(dim=(0, 3)) + self.norm.eps).flatten()).view(-1, *h.shape[1:3])
            pre = pre[:, None, None] + self.scale[0] * z[:n]
            post = post[:, None, None] + self.scale[1] * z[n:2 * n]
            res = res[:, :, None, None] + self.scale[2] * z[2 * n:].unflatten(0, (n, n))
        # H_res[target, source]: the mix's (source, target) is its transpose
        weights = torch.sigmoid(pre), sinkhorn(res).transpose(0, 1), 2 * torch.sigmoid(post)
        return tuple(t.to(h.dtype) for t in weights)  # the identity for fp32 streams

    def extra_repr(self) -> str:
        return f"streams={self.n}, dynamic={self.dynamic}, sinkhorn_iters={SINKHORN_ITERS}"


def build_connection(cfg, d: int, index: int) -> nn.Module | None:
    """The hyper-connection of the residual block `index` (0-based, in forward order within its
    stack), or None for residual=add."""
    dynamic = cfg.residual_mixing == "dynamic"
    if cfg.residual == "hyper":
        return HyperConnection(cfg.residual_streams, d, index, dynamic, cfg.norm, cfg.bias)
    if cfg.residual == "mhc":
        return ManifoldHyperConnection(cfg.residual_streams, d, index, dynamic, cfg.norm.eps)
    return None
