"""Admin (Liu et al. 2020): profiling vs a hand computation, closed form, export to post-norm."""
import math

import pytest
import torch

from normlab.config import ModelConfig
from normlab.init.admin import closed_form_omega, closed_form_omega_, export_post_norm, profile_omega_
from normlab.model.transformer import Seq2SeqTransformer

V, PAD = 29, 0


def admin_model(norm_type="layernorm", seed=0, **kw) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=3, encoder_heads=4,
                      decoder_heads=2, encoder_ffn=24, decoder_ffn=20, max_positions=64, init="admin",
                      dropout=0.3, norm={"type": norm_type, "placement": "post"}, **kw)
    return Seq2SeqTransformer(cfg)


def make_batch(B, S, T, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    tgt = torch.randint(3, V, (B, T), generator=g)
    src[0, S - 2:] = PAD
    tgt[-1, T - 3:] = PAD
    return {"src": src, "tgt_in": tgt}


def var(x, mask):
    x = x[mask].double()
    return ((x - x.mean()) ** 2).mean().item()


@torch.no_grad()
def hand_profile(model, src, tgt):
    """The paper's rule written out sub-layer by sub-layer, without hooks."""
    omegas = {}
    # encoder: 2 sub-layers per layer
    smask, tmask = src.ne(PAD), tgt.ne(PAD)
    x = model.encoder.embed(src)
    total, first = var(x, smask), True
    for li, layer in enumerate(model.encoder.layers):
        for name, block, kw in [("self_attn", layer.self_attn, {"key_padding_mask": ~smask}), ("ffn", layer.ffn, {})]:
            w = 1.0 if first else math.sqrt(total)
            f = block.sublayer(x, **kw)
            total += var(f, smask)
            x = block.norm(x * w + f)
            omegas[f"enc.{li}.{name}"], first = w, False
    memory = x
    y = model.decoder.embed(tgt)
    total, first = var(y, tmask), True
    for li, layer in enumerate(model.decoder.layers):
        for name, block, args, kw in [("self_attn", layer.self_attn, (), {"causal": True}),
                                      ("cross_attn", layer.cross_attn, (memory,), {"key_padding_mask": ~smask}),
                                      ("ffn", layer.ffn, (), {})]:
            w = 1.0 if first else math.sqrt(total)
            f = block.sublayer(y, *args, **kw)
            total += var(f, tmask)
            y = block.norm(y * w + f)
            omegas[f"dec.{li}.{name}"], first = w, False
    return omegas


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_profiled_omega_equals_hand_computation(norm_type):
    model = admin_model(norm_type).train()
    b1, b2 = make_batch(3, 7, 6, seed=1), make_batch(2, 9, 4, seed=2)  # different lengths
    report = profile_omega_(model, [b1, b2], PAD)
    assert model.training  # mode restored
    # the hand computation on the two batches padded to one
    src = torch.full((5, 9), PAD)
    tgt = torch.full((5, 6), PAD)
    src[:3, :7], src[3:] = b1["src"], b2["src"]
    tgt[:3], tgt[3:, :4] = b1["tgt_in"], b2["tgt_in"]
    expected = hand_profile(model.eval(), src, tgt)
    got = {name: block.omega for name, block in model.residual_blocks()}
    assert list(got) == list(expected)  # 2 x 2 encoder + 3 x 3 decoder sub-layers, in order
    assert len(got) == 2 * 2 + 3 * 3
    for name, w in expected.items():
        torch.testing.assert_close(got[name], torch.full((16,), w), rtol=1e-5, atol=0), name
        assert report[name[:3]][name]["omega"] == pytest.approx(w, rel=1e-5)
    assert expected["enc.0.self_attn"] == expected["dec.0.self_attn"] == 1.0
    # ω grows along each stack (each sub-layer adds variance) and the decoder starts afresh
    enc = [expected[f"enc.{i}.{n}"] for i in range(2) for n in ("self_attn", "ffn")]
    assert all(a < b for a, b in zip(enc, enc[1:]))
    assert expected["dec.0.cross_attn"] < enc[-1] + 1
    # extra padding columns change nothing
    padded = {k: torch.nn.functional.pad(v, (0, 5), value=PAD) for k, v in b1.items()}
    profile_omega_(model, [padded, b2], PAD)
    for name, w in expected.items():
        assert got[name][0].item() == pytest.approx(w, rel=1e-5)


def test_profiled_omega_second_entry_is_sqrt_of_input_plus_first_branch_variance():
    model = admin_model().eval()
    b = make_batch(4, 8, 5, seed=3)
    profile_omega_(model, [b], PAD)
    m = b["src"].ne(PAD)
    with torch.no_grad():
        x0 = model.encoder.embed(b["src"])
        f1 = model.encoder.layers[0].self_attn.sublayer(x0, key_padding_mask=~m)
    w2 = model.encoder.layers[0].ffn.omega
    assert w2[0].item() == pytest.approx(math.sqrt(var(x0, m) + var(f1, m)), rel=1e-5)
    # x0 = E·√d + PE has variance near 1 + 1/2 at xavier/fairseq init; ω_2 > 1
    assert 1.0 < w2[0].item() < 3.0


@pytest.mark.parametrize("n, value", [(12, 2.017), (18, 2.335), (36, 3.041)])
def test_closed_form_values(n, value):
    assert closed_form_omega(n) == pytest.approx(value, abs=5e-4)
    assert closed_form_omega(n) == pytest.approx(math.sqrt((n + 1) / math.log(n + 1) - 1))


def test_closed_form_fills_each_stack_with_its_own_n():
    model = admin_model()
    closed_form_omega_(model)
    for key, n in (("enc", 2 * 2), ("dec", 3 * 3)):
        for name, block in model.stacks()[key].residual_blocks(key):
            torch.testing.assert_close(block.omega.detach(), torch.full((16,), closed_form_omega(n)))


def _randomise(model, omega_first_one=True):
    with torch.no_grad():
        for m in model.modules():
            for pname in ("weight", "bias"):
                p = getattr(m, pname, None)
                if isinstance(m, (torch.nn.LayerNorm,)) or type(m).__name__ == "RMSNorm":
                    if p is not None:
                        p.uniform_(0.5, 1.5) if pname == "weight" else p.uniform_(-0.3, 0.3)
        for key, stack in model.stacks().items():
            for k, (_, block) in enumerate(stack.residual_blocks(key)):
                block.omega.uniform_(0.5, 3.0)
                if k == 0 and omega_first_one:
                    block.omega.fill_(1.0)


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_export_is_exact_for_vector_omega_when_first_omega_is_one(norm_type):
    model = admin_model(norm_type, seed=4)
    _randomise(model)
    model.eval()
    plain, report = export_post_norm(model)
    assert report == {"exact": True, "inexact": {}}
    assert plain.cfg.init == "xavier" and all(not n.endswith("omega") for n, _ in plain.named_parameters())
    b = make_batch(3, 7, 6, seed=5)
    expected = model(b["src"], b["tgt_in"])
    torch.testing.assert_close(plain.eval()(b["src"], b["tgt_in"]), expected, rtol=1e-4, atol=1e-4)
    # a model that differs (ω not folded) is far off: the tolerance above is meaningful
    unfolded = Seq2SeqTransformer(plain.cfg).eval()
    unfolded.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("omega")})
    assert (unfolded(b["src"], b["tgt_in"]) - expected).abs().max() > 1e-2


def test_export_refuses_what_is_not_exact_and_says_why():
    model = admin_model("layernorm", seed=6)
    _randomise(model, omega_first_one=False)
    with pytest.raises(ValueError, match="enc.0.self_attn.*first sub-layer"):
        export_post_norm(model)
    plain, report = export_post_norm(model, allow_inexact=True)
    assert set(report["inexact"]) == {"enc.0.self_attn", "dec.0.self_attn"} and not report["exact"]
    # ScaleNorm: exact for scalar ω (e.g. at init), not for a vector
    sn = admin_model("scalenorm", seed=7)
    closed_form_omega_(sn)
    for key, stack in sn.stacks().items():
        stack.residual_blocks(key)[0][1].omega.data.fill_(1.0)  # the first sub-layer's ω cannot be folded (see admin.py)
    plain, report = export_post_norm(sn.eval())
    b = make_batch(2, 6, 5, seed=8)
    torch.testing.assert_close(plain.eval()(b["src"], b["tgt_in"]), sn(b["src"], b["tgt_in"]), rtol=1e-4, atol=1e-4)
    _randomise(sn)
    with pytest.raises(ValueError, match="ScaleNorm has one scalar g"):
        export_post_norm(sn)


def test_sublayer_listing_ignores_layerdrop_in_training():
    # LayerDrop's ModuleList skips (and draws) when iterated in training; Admin and the diagnostics
    # must still see every sub-layer, and must not advance its draws.
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=16, encoder_layers=3, decoder_layers=2, encoder_heads=4,
                      decoder_heads=2, encoder_ffn=24, decoder_ffn=20, max_positions=64, init="admin",
                      norm={"placement": "post"},
                      regularizer={"encoder_layerdrop": 0.9, "decoder_layerdrop": 0.9})
    model = Seq2SeqTransformer(cfg).train()
    draws = [model.encoder.layers.draw_state.clone(), model.decoder.layers.draw_state.clone()]
    names = [n for n, _ in model.residual_blocks()]
    assert len(names) == 3 * 2 + 2 * 3
    assert torch.equal(model.encoder.layers.draw_state, draws[0])  # no LayerDrop draw consumed
    assert torch.equal(model.decoder.layers.draw_state, draws[1])
    profile_omega_(model, [make_batch(2, 6, 5, seed=9)], PAD)
    assert all(b.omega[0].item() > 1.0 for key, stack in model.stacks().items()
               for _, b in stack.residual_blocks(key)[1:])


def test_callback_closed_form_writes_json_and_resume_keeps_checkpoint_omega(tmp_path):
    import json
    from types import SimpleNamespace

    from normlab.callbacks.admin_init import AdminInit

    model = admin_model()
    module = SimpleNamespace(model=model, model_cfg=model.cfg)
    trainer = SimpleNamespace(ckpt_path=None, is_global_zero=True, world_size=1, default_root_dir=str(tmp_path))
    AdminInit(mode="closed_form").on_fit_start(trainer, module)
    saved = json.loads((tmp_path / "admin_omega.json").read_text())
    assert saved["mode"] == "closed_form"
    assert saved["omega"]["enc.1.ffn"] == pytest.approx(closed_form_omega(4))
    assert saved["omega"]["dec.2.cross_attn"] == pytest.approx(closed_form_omega(9))
    with torch.no_grad():
        model.encoder.layers[0].ffn.omega.fill_(7.0)  # as restored from a checkpoint
    AdminInit(mode="closed_form").on_fit_start(SimpleNamespace(**{**vars(trainer), "ckpt_path": "last.ckpt"}), module)
    assert model.encoder.layers[0].ffn.omega[0].item() == 7.0


@torch.no_grad()
def hand_profile_authors(model, src, tgt):
    """Transformer-Clinic's rule written out: ratio_1 = 1, ratio_{i+1} = √(Var[x·ω_i] + Var[F_i]),
    variances over every position (pads included); run here without dropout."""
    omegas = {}
    vall = lambda t: t.double().var(unbiased=False).item()  # noqa: E731
    pad_s = src.eq(PAD)
    x, ratio = model.encoder.embed(src), 1.0
    for li, layer in enumerate(model.encoder.layers):
        for name, block, kw in [("self_attn", layer.self_attn, {"key_padding_mask": pad_s}), ("ffn", layer.ffn, {})]:
            f = block.sublayer(x, **kw)
            omegas[f"enc.{li}.{name}"] = ratio
            x, ratio = block.norm(x * ratio + f), math.sqrt(vall(x * ratio) + vall(f))
    memory, y, ratio = x, model.decoder.embed(tgt), 1.0
    for li, layer in enumerate(model.decoder.layers):
        for name, block, args, kw in [("self_attn", layer.self_attn, (), {"causal": True}),
                                      ("cross_attn", layer.cross_attn, (memory,), {"key_padding_mask": pad_s}),
                                      ("ffn", layer.ffn, (), {})]:
            f = block.sublayer(y, *args, **kw)
            omegas[f"dec.{li}.{name}"] = ratio
            y, ratio = block.norm(y * ratio + f), math.sqrt(vall(y * ratio) + vall(f))
    return omegas


def test_authors_convention_is_transformer_clinics_rule_with_pads():
    model = admin_model()
    for m in model.modules():  # no dropout: the rule itself, deterministic
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    b = make_batch(3, 8, 6, seed=11)
    report = profile_omega_(model, [b], PAD, convention="authors")
    expected = hand_profile_authors(model.eval(), b["src"], b["tgt_in"])
    got = {name: block.omega[0].item() for name, block in model.residual_blocks()}
    assert got == pytest.approx(expected, rel=1e-5)
    assert report["dec"]["dec.0.self_attn"]["omega"] == 1.0
    profile_omega_(model, [b], PAD)
    paper = {name: block.omega[0].item() for name, block in model.residual_blocks()}
    assert paper != pytest.approx(got, rel=1e-3)  # pads and the recursion make a difference


def test_authors_convention_profiles_with_dropout_on_and_draws_no_layerdrop():
    model = admin_model(regularizer={"encoder_layerdrop": 0.5, "decoder_layerdrop": 0.5})  # dropout 0.3
    b = make_batch(3, 8, 6, seed=12)
    draws = model.encoder.layers.draw_state.clone()
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        report = profile_omega_(model, [b], PAD, convention="authors")
        runs.append([blk.omega[0].item() for _, blk in model.residual_blocks()])
        assert len(report["enc"]) == 2 * 2 and len(report["dec"]) == 3 * 3  # no block skipped
    assert runs[0] != runs[1]  # dropout drew different masks
    assert torch.equal(model.encoder.layers.draw_state, draws) and model.training
    torch.manual_seed(1)
    profile_omega_(model, [b], PAD)
    first = [blk.omega[0].item() for _, blk in model.residual_blocks()]
    torch.manual_seed(2)
    profile_omega_(model, [b], PAD)
    assert first == [blk.omega[0].item() for _, blk in model.residual_blocks()]  # paper: eval mode
