"""Memory sanity at depth: forward + backward of a d_model-64 model with N+N layers on one batch.

    .venv/bin/python experiments/norm_depth/memory_depth.py 6 36     # one process per depth
Prints parameters, CPU time and peak RSS (resource.ru_maxrss) for post-norm + Admin (profiled)
and pre-norm at each depth; the batch is 32 x 32 source and target tokens (the ablation's 1024).
"""
import resource
import subprocess
import sys
import time

import torch

from normlab.config import ModelConfig
from normlab.init.admin import profile_omega_
from normlab.model.transformer import Seq2SeqTransformer


def one(layers: int, placement: str, init: str) -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8000, d_model=64, encoder_layers=layers, decoder_layers=layers, encoder_heads=4,
                      decoder_heads=4, encoder_ffn=256, decoder_ffn=256, init=init, norm={"placement": placement})
    model = Seq2SeqTransformer(cfg)
    src, tgt = torch.randint(3, 8000, (32, 32)), torch.randint(3, 8000, (32, 32))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if init == "admin":
        profile_omega_(model, [{"src": src, "tgt_in": tgt}], cfg.pad_id)
    t = time.process_time()
    loss = torch.nn.functional.cross_entropy(model(src, tgt).reshape(-1, 8000), tgt.reshape(-1))
    loss.backward()
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"| {layers}+{layers} | {placement}/{init} | {model.num_parameters() / 1e6:.2f}M | {finite} | "
            f"{time.process_time() - t:.2f} | {base:.0f} | {peak:.0f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(one(int(sys.argv[2]), sys.argv[3], sys.argv[4]))
    else:
        print("| layers | arm | params | grads finite | fwd+bwd CPU-s | RSS after build (MB) | peak RSS (MB) |")
        print("|---|---|---|---|---|---|---|")
        for n in sys.argv[1:] or ["6", "36"]:
            for placement, init in (("post", "admin"), ("pre", "xavier")):
                subprocess.run([sys.executable, __file__, "--one", n, placement, init], check=True)
