"""The residual schemes compute what they computed before they were objects (issue 20): for every
placement (and Admin, DLCL pre- and post-like, ResiDual), a model built from a fixed seed gives the
same outputs, the same gradients, the same state-dict keys in the same order and the same parameter
sums as the code before the refactor (b52f3b0); run-name labels are unchanged.
A failure here means a checkpoint or a run name no longer means what it did: fix the code, never
the pins.

The pins were taken on one CPU (an AVX-512 kernel path); another CPU, or ATen's `default` kernels,
sums in another order and lands a few fp32 ulps away (issue 34: 1e-8 to 5e-6 relative on an AMD
EPYC with AVX2). So the floats are compared at fp32 rounding, TOL relative to the size of what was
summed (an element against its tensor's mean |x|): a change of code moves them by O(1) of that,
10^4-10^5 times more. Keys, their order and the labels stay exact."""
import hashlib

import pytest
import torch

from normlab import identity
from normlab.config import ModelConfig
from normlab.model.transformer import Seq2SeqTransformer

V, PAD = 31, 0
DROPOUTS = dict(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
CASES = {
    "post": dict(norm={"placement": "post"}),
    "pre": dict(norm={"placement": "pre"}),
    "deepnorm": dict(norm={"placement": "deepnorm"}),
    "subln": dict(norm={"placement": "subln"}),
    "sandwich": dict(norm={"placement": "sandwich"}),
    "rezero": dict(norm={"placement": "rezero", "type": "none"}),
    "resi_dual": dict(norm={"placement": "resi_dual"}),
    "post_admin": dict(norm={"placement": "post"}, init="admin"),
    "dlcl_pre": dict(norm={"placement": "pre"}, layer_aggregation="dlcl"),
    "dlcl_post": dict(norm={"placement": "post"}, layer_aggregation="dlcl"),
    "dlcl_subln_encoder": dict(norm={"placement": "subln", "type": "rmsnorm"}, layer_aggregation="dlcl",
                               layer_aggregation_stacks="encoder"),
    "pre_scalenorm_fixnorm": dict(norm={"placement": "pre", "type": "scalenorm", "fixnorm": True}),
    "sandwich_dyt": dict(norm={"placement": "sandwich", "type": "dyt"}),
    "resi_dual_rmsnorm": dict(norm={"placement": "resi_dual", "type": "rmsnorm"}),
}
LABEL_CASES = [dict(placement=p, type=t, fixnorm=f)
               for p in ("post", "pre", "deepnorm", "subln", "sandwich", "rezero", "resi_dual")
               for t in ("layernorm", "scalenorm", "rmsnorm", "dyt", "none") for f in (False, True)] + [{}]

PINNED = {
    'post': {
        'keys': 'f4796c45d731669b', 'n_keys': 103, 'params': '225.17275796230388', 'grads': '2650.6958450806005',
        'train': ('-15.391174173913896', '329.5218356717378', '-0.08712146431207657', '1.9963955879211426'),
        'eval': ('34.944323871750385', '343.50224731164053', '0.002710241125896573', '2.0731375217437744'),
        'cached': ('21.70763394027017', '200.85219542100094', '0.002709935652092099', '2.0290369987487793'),
    },
    'pre': {
        'keys': '1591d1fa1d74f3cd', 'n_keys': 107, 'params': '257.1727579623039', 'grads': '2240.0414819833295',
        'train': ('78.29666801542044', '377.2784835845232', '0.05747443065047264', '1.9008679389953613'),
        'eval': ('106.6153127369762', '369.7320462260104', '-0.27817702293395996', '2.2998740673065186'),
        'cached': ('61.431565182079794', '216.64470999242621', '-0.2781771719455719', '0.6469356417655945'),
    },
    'deepnorm': {
        'keys': '993cf659755560b8', 'n_keys': 115, 'params': '224.796430587925', 'grads': '894.7404611383287',
        'train': ('45.92296225298196', '373.83633697684854', '-1.675127387046814', '1.7375720739364624'),
        'eval': ('72.80806092190323', '386.6691996108857', '-1.660867691040039', '1.0558531284332275'),
        'cached': ('32.85457967221737', '233.2572856610641', '-1.6608678102493286', '-0.6995645761489868'),
    },
    'subln': {
        'keys': 'c2e5b27273faf04b', 'n_keys': 127, 'params': '455.6076921161766', 'grads': '2150.3505190234887',
        'train': ('17.284609808470123', '367.66340520314407', '0.18810588121414185', '1.7165186405181885'),
        'eval': ('-2.326329299248755', '379.06885435432196', '-0.3887414038181305', '1.5081838369369507'),
        'cached': ('10.428992695640773', '221.67333863908425', '-0.38874131441116333', '0.239057719707489'),
    },
    'sandwich': {
        'keys': '5908b73e86b3039d', 'n_keys': 131, 'params': '449.1727579623039', 'grads': '3077.8235203749837',
        'train': ('68.70986942073796', '367.47050236409996', '-0.670497477054596', '1.5672829151153564'),
        'eval': ('108.3604526296258', '374.6121514234692', '-0.28700169920921326', '2.506577491760254'),
        'cached': ('63.82153236004524', '216.1842449491378', '-0.28700149059295654', '1.246738314628601'),
    },
    'rezero': {
        'keys': '28c379dcf77a1631', 'n_keys': 91, 'params': '33.172757962303876', 'grads': '278.07433506160305',
        'train': ('47.73239474953152', '424.6832804174628', '-1.480666995048523', '1.319351315498352'),
        'eval': ('65.50808887090534', '424.9617328373715', '-1.7083559036254883', '0.5771128535270691'),
        'cached': ('29.220819036941975', '257.37905500410125', '-1.7083559036254883', '-1.4270827770233154'),
    },
    'resi_dual': {
        'keys': '978a815629eba0ff', 'n_keys': 107, 'params': '257.1727579623039', 'grads': '6860.272912093969',
        'train': ('58.20269253477454', '644.2011188827455', '0.8055345416069031', '3.965287446975708'),
        'eval': ('220.2843714817427', '731.3147513703443', '1.0394636392593384', '4.345085620880127'),
        'cached': ('121.59542126720771', '420.3997126617469', '1.0394635200500488', '3.3898489475250244'),
    },
    'post_admin': {
        'keys': '857c851dd3861dbb', 'n_keys': 115, 'params': '417.1727579623039', 'grads': '2711.440804428482',
        'train': ('-15.391174173913896', '329.5218356717378', '-0.08712146431207657', '1.9963955879211426'),
        'eval': ('34.944323871750385', '343.50224731164053', '0.002710241125896573', '2.0731375217437744'),
        'cached': ('21.70763394027017', '200.85219542100094', '0.002709935652092099', '2.0290369987487793'),
    },
    'dlcl_pre': {
        'keys': 'acf1c1644c508f9f', 'n_keys': 119, 'params': '344.1727580219085', 'grads': '897.724775576045',
        'train': ('54.91630314348731', '374.6646979780635', '-1.383642315864563', '2.127223491668701'),
        'eval': ('77.89344159606844', '388.0997160701081', '-1.506249189376831', '1.836369514465332'),
        'cached': ('39.46342026581988', '230.8355388888158', '-1.5062493085861206', '-0.2036692053079605'),
    },
    'dlcl_post': {
        'keys': 'f70c440fbe1b4301', 'n_keys': 115, 'params': '312.1727580219085', 'grads': '1103.9844005311386',
        'train': ('60.499392155965324', '367.6461146878428', '-1.3626840114593506', '2.137451171875'),
        'eval': ('87.16698720655404', '378.6078643051442', '-1.554131269454956', '1.8923448324203491'),
        'cached': ('43.94232306047343', '219.8234514647629', '-1.5541317462921143', '0.23913252353668213'),
    },
    'dlcl_subln_encoder': {
        'keys': '0d723bb8085511d5', 'n_keys': 107, 'params': '507.60769214597894', 'grads': '1585.8911303429727',
        'train': ('39.40126286827581', '354.6936429617126', '-0.5144467353820801', '0.5504826307296753'),
        'eval': ('2.2793544648156967', '357.5523910363263', '-0.6132320761680603', '1.0435717105865479'),
        'cached': ('10.257403936295304', '208.77743982564425', '-0.6132318377494812', '-0.39327481389045715'),
    },
    'pre_scalenorm_fixnorm': {
        'keys': '963a7271cfa60ed2', 'n_keys': 93, 'params': '89.17275796230388', 'grads': '2182397572689.9624',
        'train': ('95.8570077806362', '363.2074823624571', '-0.27564293146133423', '0.027274450287222862'),
        'eval': ('100.05464437836781', '357.05464027123526', '-0.255657821893692', '-0.3808131515979767'),
        'cached': ('58.78557534283027', '212.1801617271267', '-0.2556578814983368', '-1.1063709259033203'),
    },
    'sandwich_dyt': {
        'keys': 'df3cab5dc3218385', 'n_keys': 157, 'params': '462.1727579623039', 'grads': '312.41099598489046',
        'train': ('24.922059177421033', '175.82408443372697', '-0.845089852809906', '0.5704315900802612'),
        'eval': ('33.78982211695984', '183.36594783188775', '-0.9288126826286316', '0.13346987962722778'),
        'cached': ('16.426648695021868', '112.7930793967098', '-0.9288126826286316', '-0.6526457071304321'),
    },
    'resi_dual_rmsnorm': {
        'keys': '3ff5228e55542361', 'n_keys': 93, 'params': '257.1727579623039', 'grads': '7762.074973913721',
        'train': ('133.24661976331845', '614.2916850843467', '0.47798651456832886', '0.8235142827033997'),
        'eval': ('161.12074301112443', '564.205782582052', '1.482532024383545', '0.699568510055542'),
        'cached': ('92.68068755045533', '332.80994713678956', '1.4825325012207031', '-0.30336928367614746'),
    },
}
LABELS = [
    'post_ln', 'post_ln_fixnorm', 'post_scalenorm', 'post_scalenorm_fixnorm', 'post_rmsnorm',
    'post_rmsnorm_fixnorm', 'post_dyt', 'post_dyt_fixnorm', 'post_none', 'post_none_fixnorm',
    'pre_ln', 'pre_ln_fixnorm', 'pre_scalenorm', 'pre_scalenorm_fixnorm', 'pre_rmsnorm',
    'pre_rmsnorm_fixnorm', 'pre_dyt', 'pre_dyt_fixnorm', 'pre_none', 'pre_none_fixnorm',
    'deepnorm', 'deepnorm_fixnorm', 'deepnorm_scalenorm', 'deepnorm_scalenorm_fixnorm', 'deepnorm_rmsnorm',
    'deepnorm_rmsnorm_fixnorm', 'deepnorm_dyt', 'deepnorm_dyt_fixnorm', 'deepnorm', 'deepnorm_fixnorm',
    'subln', 'subln_fixnorm', 'subln_scalenorm', 'subln_scalenorm_fixnorm', 'subln_rmsnorm',
    'subln_rmsnorm_fixnorm', 'subln_dyt', 'subln_dyt_fixnorm', 'subln', 'subln_fixnorm',
    'sandwich', 'sandwich_fixnorm', 'sandwich_scalenorm', 'sandwich_scalenorm_fixnorm', 'sandwich_rmsnorm',
    'sandwich_rmsnorm_fixnorm', 'sandwich_dyt', 'sandwich_dyt_fixnorm', 'sandwich', 'sandwich_fixnorm',
    'rezero', 'rezero_fixnorm', 'rezero_scalenorm', 'rezero_scalenorm_fixnorm', 'rezero_rmsnorm',
    'rezero_rmsnorm_fixnorm', 'rezero_dyt', 'rezero_dyt_fixnorm', 'rezero', 'rezero_fixnorm',
    'resi_dual', 'resi_dual_fixnorm', 'resi_dual_scalenorm', 'resi_dual_scalenorm_fixnorm', 'resi_dual_rmsnorm',
    'resi_dual_rmsnorm_fixnorm', 'resi_dual_dyt', 'resi_dual_dyt_fixnorm', 'resi_dual', 'resi_dual_fixnorm',
    'post_ln',
]


def _model(case: str) -> Seq2SeqTransformer:
    torch.manual_seed(1234)
    cfg = ModelConfig(vocab_size=V, d_model=16, encoder_layers=3, decoder_layers=2, encoder_heads=2,
                      decoder_heads=2, encoder_ffn=24, decoder_ffn=20, max_positions=32, **DROPOUTS,
                      **CASES[case])
    return Seq2SeqTransformer(cfg)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    src, tgt = torch.randint(3, V, (3, 7), generator=g), torch.randint(3, V, (3, 5), generator=g)
    src[0, 5:] = PAD
    return src, tgt


TOL = 1e-5  # relative, fp32 rounding of a forward + backward of 5 layers under any summation order


def _sums(t: torch.Tensor) -> tuple[str, ...]:
    flat = t.detach().double().flatten()
    return tuple(repr(float(v)) for v in (flat.sum(), flat.abs().sum(), flat[1], flat[len(flat) // 2]))


def _off(got: dict, want: dict) -> dict:
    """The entries of a fingerprint that differ from the pins by more than fp32 rounding: exact for
    the keys, TOL of the abs sum for a tensor's sum and elements (mean |x| per element)."""
    bad = {k: (got[k], want[k]) for k in ("keys", "n_keys") if got[k] != want[k]}
    for k in ("params", "grads"):
        if abs(float(got[k]) - float(want[k])) > TOL * abs(float(want[k])):
            bad[k] = (got[k], want[k])
    for k in ("train", "eval", "cached"):
        (g_sum, g_abs, *g_el), (w_sum, w_abs, *w_el) = map(lambda v: [float(x) for x in v], (got[k], want[k]))
        numel = 3 * {"cached": 3}.get(k, 5) * V  # (B, T, V) of the output
        scales = [float(w_abs)] * 2 + [float(w_abs) / numel] * len(w_el)
        if any(abs(g - w) > TOL * s for g, w, s in zip([g_sum, g_abs, *g_el], [w_sum, w_abs, *w_el], scales)):
            bad[k] = (got[k], want[k])
    return bad


def fingerprint(case: str) -> dict:
    model = _model(case)
    src, tgt = _batch()
    state = model.state_dict()
    keys = list(state)
    params = repr(float(sum(v.double().sum() for v in state.values() if v.is_floating_point())))
    model.train()
    torch.manual_seed(99)  # the dropout masks
    out = model(src, tgt)
    out.float().logsumexp(-1).sum().backward()
    grads = repr(float(sum(p.grad.double().abs().sum() for p in model.parameters() if p.grad is not None)))
    model.eval()
    with torch.no_grad():
        evaluated = model(src, tgt)
        memory, mask = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i:i + 1], memory, mask, cache) for i in range(3)]
    return {"keys": hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16], "n_keys": len(keys),
            "params": params, "train": _sums(out), "grads": grads, "eval": _sums(evaluated),
            "cached": _sums(torch.cat(steps, dim=1))}


@pytest.mark.parametrize("case", CASES)
def test_each_scheme_computes_what_it_did(case):
    assert _off(fingerprint(case), PINNED[case]) == {}


def test_the_tolerance_sees_a_change_of_code():
    # a small change of code: LayerNorm's eps 1e-5 -> 1e-3 moves the outputs by ~50x TOL; a pin off
    # by 20x TOL is seen too
    got = fingerprint("post")
    assert _off(got, PINNED["post"]) == {}
    bumped = {**got, "grads": repr(float(got["grads"]) * (1 + 20 * TOL))}
    assert set(_off(bumped, PINNED["post"])) == {"grads"}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.LayerNorm, "__init__", _eps(torch.nn.LayerNorm.__init__))
        assert {"train", "eval", "cached", "grads"} <= set(_off(fingerprint("post"), PINNED["post"]))


def _eps(init):
    def with_eps(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.eps = 1e-3
    return with_eps


def test_run_name_labels_are_unchanged():
    assert [identity.norm_label(norm) for norm in LABEL_CASES] == LABELS


# Schemes added after the pins (issue 20, item 2): a placement name of their own, alone with LayerNorm.
NEW_LABELS = {
    ("b2t", "layernorm", False): "b2t", ("b2t", "rmsnorm", False): "b2t_rmsnorm",
    ("b2t", "scalenorm", True): "b2t_scalenorm_fixnorm",
    ("reordered", "layernorm", False): "reordered", ("reordered", "dyt", False): "reordered_dyt",
    ("pre_scaled", "layernorm", False): "pre_scaled", ("pre_scaled", "rmsnorm", False): "pre_scaled_rmsnorm",
    ("mix", "layernorm", False): "mix", ("mix", "rmsnorm", False): "mix_rmsnorm",
    ("hybrid", "layernorm", False): "hybrid", ("hybrid", "rmsnorm", False): "hybrid_rmsnorm",
    ("hybrid_star", "layernorm", False): "hybrid_star", ("hybrid_star", "rmsnorm", False): "hybrid_star_rmsnorm",
}


def test_labels_of_the_new_schemes_are_pinned():
    assert {key: identity.norm_label(dict(placement=key[0], type=key[1], fixnorm=key[2])) for key in NEW_LABELS} \
        == NEW_LABELS
