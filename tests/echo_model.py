"""A tiny Llama whose next token depends on the current token alone, with official-format Hydra
heads that predict it: the fixture of banks built where they are needed (tests/test_ondemand.py,
the browser test, scripts/ondemand_race.py).

Its layers add nothing to the residual stream (every o_proj and down_proj is zero), so the last
state is the current token's embedding, normalised, and the LM head (the embedding's rows moved
down one place, scaled so that the model is sure of itself) puts token t + 1 after token t: its
answers are runs of consecutive token ids, text on the page. Head d of the Hydra file reads
[state ; E(root) ; ... ; E(path_d)], passes the last embedding on unchanged (its ResBlock's
residual map selects it, its SiLU branch is zero) and scores it with the same rows: the token the
model puts after path_d. So drafts are
accepted far down the chain, as a trained head's would be, and a bank built on it has trees to
choose from. Written as zankner/Hydra's trainer saves a checkpoint (`hydra_lm_head.pt` and its
config), as tests/test_heads.py writes the official layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from entmtp.runtime.weights import default_gguf

HIDDEN, HEADS = 32, 4


def echo_model(d: Path, max_positions: int = 2048) -> tuple[Path, Path]:
    """(model folder, Hydra heads folder) under `d`, written once."""
    model_dir, heads_dir = d / "echo-llama", d / "echo-llama-hydra"
    if (heads_dir / "hydra_lm_head.pt").exists():
        return model_dir, heads_dir
    gguf = default_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(embed.roll(1, dims=0) * 100)  # row j scores token j - 1's embedding: t is followed by t + 1
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    state = {"input_embed_fn.weight": embed.detach().clone()}
    for i in range(HEADS):
        width = HIDDEN * (i + 2)
        select = torch.zeros(HIDDEN, width)
        select[:, width - HIDDEN:] = torch.eye(HIDDEN)
        state |= {f"hydra_mlp.{i}.0.linear.weight": torch.zeros(HIDDEN, width), f"hydra_mlp.{i}.0.linear.bias": torch.zeros(HIDDEN),
                  f"hydra_mlp.{i}.0.res_connection.weight": select, f"hydra_mlp.{i}.0.res_connection.bias": torch.zeros(HIDDEN),
                  f"hydra_lm_head.{i}.weight": embed.detach().roll(1, dims=0) * 5000, f"hydra_lm_head.{i}.bias": torch.zeros(len(tok))}
    heads_dir.mkdir(parents=True, exist_ok=True)
    (heads_dir / "config.json").write_text(json.dumps({
        "base_model_name_or_path": "echo-llama", "grounded_heads": True, "hidden_state_offset": 0, "hydra_head_arch": "mlp",
        "hydra_num_heads": HEADS, "hydra_num_layers": 1, "transformers_version": "4.35.2"}))
    torch.save(state, heads_dir / "hydra_lm_head.pt")
    return model_dir, heads_dir
