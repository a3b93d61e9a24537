"""Our heads format and the official Hydra / Medusa layouts.

The official files are written here by small re-implementations of the authors' modules
(zankner/Hydra `mlp_head.HydraMLP`, `prefix_mlp_head.HydraPrefixMLP` and its Llama layer;
FasterDecoding/Medusa's `medusa_head` in both versions), saved the way their training scripts
save them (`hydra_head.state_dict()`, `medusa_head.state_dict()`), so the key lists are whatever
those module trees give, tied blocks and saved buffers included. Loaded heads must reproduce the
re-implemented modules' logits.
"""

import copy
import json
import math
import re

import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import constants
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from entmtp.config import TREES_FILE
from entmtp.spec.heads import HeadsError, HeadsWarning
from entmtp.spec.headfiles import fetch_hub_heads, load_heads, save_heads
from entmtp.spec.topology import load_named_trees
from conftest import random_heads
from test_engine import reference, run

TREE = load_named_trees(TREES_FILE)["mc_sim_7b_63"]
TOL = 1e-4


# -- the authors' modules, re-implemented at tiny size ------------------------------------------


class OrigResBlock(nn.Module):
    """Hydra's ResBlock: `res(x) + SiLU(W x + b)`, res a linear map when the input is widened."""

    def __init__(self, hidden, num_condition=0):
        super().__init__()
        width = hidden * (num_condition + 1)
        self.linear = nn.Linear(width, hidden)
        self.res_connection = nn.Linear(width, hidden) if num_condition else nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x):
        return self.res_connection(x) + self.act(self.linear(x))


class OrigMedusaResBlock(nn.Module):
    """Medusa's ResBlock: `x + SiLU(W x + b)`."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class OldRMSNorm(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class OldRotary(nn.Module):
    """The Llama code Hydra++ ships registers inv_freq as a saved buffer."""

    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, pos):  # (T,) -> cos, sin (T, dim)
        freqs = pos[:, None].float() * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class OldAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.nh, self.nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = h // self.nh
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.rotary_emb = OldRotary(self.hd, cfg.rope_parameters["rope_theta"])

    def forward(self, x):  # (T, H), causal over T
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.hd).transpose(0, 1)  # (nh, T, hd)
        k = self.k_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)
        v = self.v_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)
        cos, sin = self.rotary_emb(torch.arange(t))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (z.repeat_interleave(self.nh // self.nkv, 0) for z in (k, v))
        scores = q @ k.transpose(1, 2) / math.sqrt(self.hd)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1))


class OldMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(h, m, bias=False), nn.Linear(h, m, bias=False)
        self.down_proj = nn.Linear(m, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OldDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.mlp = OldAttention(cfg), OldMLP(cfg)
        self.input_layernorm = OldRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OldRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class OldLlamaModel(nn.Module):
    """Hydra++'s prefix layer: the base model's architecture with one decoder layer."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([OldDecoderLayer(cfg)])
        self.norm = OldRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, inputs_embeds):  # (T, H)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class OrigHydraHead(nn.Module):
    """zankner/Hydra's HydraMLP (`mlp`) and HydraPrefixMLP (`prefix-mlp`), as their trainer saves them."""

    def __init__(self, cfg, input_embed_fn, num_heads, num_layers, grounded=True, prefix=False):
        super().__init__()
        h, v = cfg.hidden_size, cfg.vocab_size
        self.grounded, self.prefix, self.num_heads = grounded, prefix, num_heads
        if prefix:
            self.prefix_embeding_layer = OldLlamaModel(LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1}))
        self.input_embed_fn = input_embed_fn  # the base model's embedding, a submodule: it is saved
        mlps = []
        for i in range(num_heads):
            # list repetition as upstream writes it: blocks after the first are one shared module
            # (all of them when ungrounded), so their keys repeat one tensor
            if prefix:
                first = [nn.Dropout(0.0), OrigResBlock(h, i + 1)] if grounded else []
                rest = [nn.Dropout(0.0), OrigResBlock(h)] * (num_layers - 1 if grounded else num_layers)
            else:
                first = [OrigResBlock(h, i + 1)] if grounded else []
                rest = [OrigResBlock(h)] * (num_layers - 1 if grounded else num_layers)
            mlps.append(nn.Sequential(*first, *rest))
        self.hydra_mlp = nn.ModuleList(mlps)
        lm = [nn.Linear(h, v) for _ in range(num_heads)]
        self.hydra_lm_head = nn.ModuleList(nn.Sequential(nn.Dropout(0.0), x) if prefix else x for x in lm)

    def forward(self, base_hidden, input_ids):
        """Training forward: base_hidden (T, H), input_ids (T,) -> per head (T, V).

        Head i at position t reads [x_t ; E(id_{t+1}) ; ... ; E(id_{t+1+i})] (torch.roll, so the
        last i+1 positions wrap around and are not compared).
        """
        x = self.prefix_embeding_layer(base_hidden) if self.prefix else base_hidden
        if self.grounded:
            emb = self.input_embed_fn(input_ids)
            inputs = [x] + [torch.roll(emb, -(i + 1), dims=0) for i in range(self.num_heads)]
            hidden = [self.hydra_mlp[i](torch.cat(inputs[: i + 2], -1)) for i in range(self.num_heads)]
        else:
            hidden = [self.hydra_mlp[i](x) for i in range(self.num_heads)]
        return [self.hydra_lm_head[i](hidden[i]) for i in range(self.num_heads)]


def orig_medusa_head(cfg, num_heads, num_layers, own_lm_head=True):
    """FasterDecoding/Medusa's `medusa_head` (version 2: no per-head LM head), tied ResBlocks as upstream."""
    h, v = cfg.hidden_size, cfg.vocab_size

    def head():
        mods = [OrigMedusaResBlock(h)] * num_layers  # one module repeated, as upstream writes it
        if own_lm_head:
            mods.append(nn.Linear(h, v, bias=False))
        return nn.Sequential(*mods)

    return nn.ModuleList(head() for _ in range(num_heads))


def randomize(module, seed):
    """Random weights everywhere (the authors zero-init W; outputs would not test much)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def rounded(state, dtype):
    return {k: v.to(dtype) for k, v in state.items()}


# -- writing them as published -----------------------------------------------------------------


def hydra_config(num_heads, num_layers, arch, grounded=True, **extra):
    """As HydraConfig.save_pretrained writes it (every field of the class)."""
    return {
        "base_model_name_or_path": "tiny",
        "grounded_heads": grounded,
        "hidden_state_offset": 0,
        "hydra_head_arch": arch,
        "hydra_num_heads": num_heads,
        "hydra_num_layers": num_layers,
        "transformers_version": "4.35.2",
        **extra,
    }


def write(d, config, filename, state):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    if filename.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / filename))
    else:
        torch.save(state, d / filename)
    return d


def official_hydra(model, tmp_path, arch="mlp", num_heads=4, num_layers=1, grounded=True, dtype=torch.float32, config=None):
    """(directory, original module with the file's values) for an official Hydra checkpoint."""
    embed = copy.deepcopy(model.get_input_embeddings())  # the base model's weights, not its module: tests share it
    orig = OrigHydraHead(model.config, embed, num_heads, num_layers, grounded, arch == "prefix-mlp")
    for part, seed in ((orig.hydra_mlp, 1), (orig.hydra_lm_head, 2), (getattr(orig, "prefix_embeding_layer", None), 3)):
        if part is not None:
            randomize(part, seed)  # parameters only: the RoPE buffer keeps its computed value
    state = rounded(orig.state_dict(), dtype)
    cfg = config if config is not None else hydra_config(num_heads, num_layers, arch, grounded)
    d = write(tmp_path / f"hydra-{arch}-{num_layers}-{dtype}".replace("torch.", ""), cfg, "hydra_lm_head.pt", state)
    # the file's values, computed in float32 over the float32 base embedding we bind to
    heads_only = {k: v.float() for k, v in state.items() if not k.startswith("input_embed_fn.")}
    orig.load_state_dict(heads_only, strict=False)
    return d, orig


def official_medusa(model, tmp_path, num_heads=5, num_layers=1, own_lm_head=True, fmt="pt", dtype=torch.float32, config=None):
    """(directory, original medusa_head) for an official Medusa checkpoint; config says 2 heads as published."""
    orig = randomize(orig_medusa_head(model.config, num_heads, num_layers, own_lm_head), 4)
    state = rounded(orig.state_dict(), dtype)
    if config is None:
        config = {"base_model_name_or_path": "tiny", "medusa_num_heads": 2, "medusa_num_layers": num_layers}
        if not own_lm_head:
            config.update(version="2", medusa_num_heads=num_heads)
    if fmt == "safetensors":  # safetensors refuses shared storage: give tied blocks their own copy
        state = {k: v.clone() for k, v in state.items()}
    name = f"medusa_lm_head.{fmt}"
    d = write(tmp_path / f"medusa-{num_heads}-{num_layers}-{own_lm_head}-{fmt}-{dtype}".replace("torch.", ""), config, name, state)
    orig.load_state_dict({k: v.float() for k, v in state.items()})
    return d, orig


# -- every published layout loads and reproduces the original logits ---------------------------


def hydra_case(model, heads, orig, seed=0, length=9):
    """Max |ours - original| over heads and positions of a random sequence."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(length, model.config.hidden_size, generator=g)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=g)
    with torch.no_grad():
        want = orig(hidden, ids)
        ctx = heads.new_context()
        worst = 0.0
        for t in range(length - heads.num_heads - 1):
            feature = ctx.observe(hidden[t : t + 1])[None]  # (1, H): Hydra++'s prefix layer runs incrementally
            for i in range(heads.num_heads):
                got = heads.head_logits(i, feature, ids[None, t + 1 : t + 2 + i])[0]
                worst = max(worst, float((got - want[i][t]).abs().max()))
    return worst


HYDRA_LAYOUTS = [
    ("mlp", 1, True),
    ("mlp", 3, True),  # blocks 1 and 2 are one module upstream: two keys, one tensor
    ("prefix-mlp", 1, True),
    ("prefix-mlp", 2, True),
    ("mlp", 2, False),  # ungrounded: every block is the same module
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch, layers, grounded", HYDRA_LAYOUTS)
def test_official_hydra_files_reproduce_the_original_module(model, tmp_path, recwarn, arch, layers, grounded, dtype):
    d, orig = official_hydra(model, tmp_path, arch, num_layers=layers, grounded=grounded, dtype=dtype)
    saved = torch.load(d / "hydra_lm_head.pt")
    assert "input_embed_fn.weight" in saved
    assert any(k.endswith("rotary_emb.inv_freq") for k in saved) == (arch == "prefix-mlp")
    heads = load_heads(d, model.config).bind(model)
    assert (heads.arch, heads.num_heads, heads.num_layers, heads.grounded) == (arch, 4, layers, grounded)
    assert hydra_case(model, heads, orig) <= TOL
    assert not [w for w in recwarn if issubclass(w.category, HeadsWarning)]  # nothing to report
    assert "notes" not in heads.provenance and heads.provenance["layout"] == f"hydra {arch}"


def test_hydra_grounded_heads_defaults_to_false(model, tmp_path):
    cfg = hydra_config(4, 2, "mlp")
    del cfg["grounded_heads"]
    d, orig = official_hydra(model, tmp_path, "mlp", num_layers=2, grounded=False, config=cfg)
    heads = load_heads(d, model.config).bind(model)
    assert not heads.grounded and hydra_case(model, heads, orig) <= TOL
    d, _ = official_hydra(model, tmp_path / "g", "mlp", config=cfg)
    with pytest.raises(HeadsError, match=r"config.json: grounded_heads is False \(absent\) but hydra_lm_head.pt holds grounded heads"):
        load_heads(d, model.config)


def medusa_case(model, heads, orig, own_lm_head, seed=0):
    hidden = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        worst = 0.0
        for i in range(heads.num_heads):
            want = orig[i](hidden) if own_lm_head else model.lm_head(orig[i](hidden))
            got = heads.head_logits(i, hidden, torch.zeros(7, 1, dtype=torch.long))
            worst = max(worst, float((got - want).abs().max()))
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "layers, own_lm_head, fmt",
    [(1, True, "pt"), (2, True, "pt"), (1, False, "safetensors"), (2, False, "safetensors")],
)
def test_official_medusa_files_reproduce_the_original_module(model, tmp_path, layers, own_lm_head, fmt, dtype):
    d, orig = official_medusa(model, tmp_path, 5, layers, own_lm_head, fmt, dtype)
    if own_lm_head:  # the published configs say 2 heads while the files hold 5: the keys win, with a note
        with pytest.warns(HeadsWarning, match=r"config.json: medusa_num_heads is 2 but medusa_lm_head.pt holds 5; using 5"):
            heads = load_heads(d, model.config)
        assert len(heads.provenance["notes"]) == 1
    else:
        heads = load_heads(d, model.config)
        assert "notes" not in heads.provenance
    heads.bind(model)
    assert (heads.num_heads, heads.num_layers, heads.shared_lm_head) == (5, layers, not own_lm_head)
    assert medusa_case(model, heads, orig, own_lm_head) <= TOL


def test_medusa_version_that_disagrees_with_the_file_is_noted(model, tmp_path):
    cfg = {"medusa_num_heads": 5, "medusa_num_layers": 1, "version": "2"}
    d, orig = official_medusa(model, tmp_path, own_lm_head=True, config=cfg)
    with pytest.warns(HeadsWarning, match="version '2' but medusa_lm_head.pt is laid out for per-head LM heads"):
        heads = load_heads(d, model.config)
    assert medusa_case(model, heads.bind(model), orig, True) <= TOL


def test_hydra_counts_come_from_the_keys(model, tmp_path):
    cfg = hydra_config(2, 1, "mlp")  # the file holds 4 heads of 3 layers
    d, orig = official_hydra(model, tmp_path, "mlp", num_layers=3, config=cfg)
    with pytest.warns(HeadsWarning) as caught:
        heads = load_heads(d, model.config).bind(model)
    assert {str(w.message).split(": ", 1)[1] for w in caught if w.category is HeadsWarning} == {
        "hydra_num_heads is 2 but hydra_lm_head.pt holds 4; using 4",
        "hydra_num_layers is 1 but hydra_lm_head.pt holds 3; using 3",
    }
    assert hydra_case(model, heads, orig) <= TOL


def test_base_embedding_that_differs_is_reported(model, tmp_path):
    d, _ = official_hydra(model, tmp_path)
    state = torch.load(d / "hydra_lm_head.pt")
    state["input_embed_fn.weight"] = state["input_embed_fn.weight"] + 1.0
    torch.save(state, d / "hydra_lm_head.pt")
    heads = load_heads(d, model.config)
    said = f"{d / 'hydra_lm_head.pt'}: input_embed_fn.weight (the base embedding saved with the heads) differs"
    with pytest.warns(HeadsWarning, match=re.escape(said)):
        heads.bind(model)
    assert "trained on another base model" in heads.provenance["notes"][0]


def test_prefix_rope_that_differs_is_reported(model, tmp_path):
    d, _ = official_hydra(model, tmp_path, "prefix-mlp")
    state = torch.load(d / "hydra_lm_head.pt")
    key = "prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"
    state[key] = state[key] * 2
    torch.save(state, d / "hydra_lm_head.pt")
    with pytest.warns(HeadsWarning, match=f"hydra_lm_head.pt: {key} differs from the RoPE frequencies"):
        load_heads(d, model.config)


@pytest.mark.parametrize("arch, layers", [("mlp", 2), ("prefix-mlp", 1)])
def test_official_hydra_layout_decodes_exactly(model, prompts, tmp_path, arch, layers):
    heads = load_heads(official_hydra(model, tmp_path, arch, num_layers=layers)[0], model.config).bind(model)
    assert heads.kind == "hydra" and heads.arch == arch and not heads.shared_lm_head
    for prompt in prompts:
        assert run(model, prompt, TREE, heads).token_ids == reference(model, prompt, 30)


@pytest.mark.filterwarnings("ignore:.*medusa_num_heads is 2 but")
@pytest.mark.parametrize("own_lm_head, fmt", [(True, "pt"), (False, "safetensors")])
def test_official_medusa_layout_decodes_exactly(model, prompts, tmp_path, own_lm_head, fmt):
    heads = load_heads(official_medusa(model, tmp_path, own_lm_head=own_lm_head, fmt=fmt)[0], model.config).bind(model)
    assert heads.kind == "medusa"
    for prompt in prompts:
        assert run(model, prompt, TREE, heads).token_ids == reference(model, prompt, 30)


def test_loaded_weights_are_the_written_ones(model, tmp_path):
    d, _ = official_hydra(model, tmp_path, num_layers=3)
    state = torch.load(d / "hydra_lm_head.pt")
    mine = load_heads(d, model.config).state_dict()
    assert set(mine) == set(state) - {"input_embed_fn.weight"}
    for k in mine:
        assert torch.equal(mine[k], state[k])


# -- refusals name the file and the reason -----------------------------------------------------


def test_files_that_do_not_match_their_layout(model, tmp_path):
    d, _ = official_hydra(model, tmp_path)
    weights = d / "hydra_lm_head.pt"
    state = torch.load(weights)
    missing = {k: v for k, v in state.items() if k != "hydra_mlp.2.0.res_connection.bias"}
    torch.save(missing, weights)
    where = re.escape(str(weights))
    with pytest.raises(HeadsError, match=rf"{where}: key mismatch: missing 1 key\(s\).*hydra_mlp.2.0.res_connection.bias"):
        load_heads(d, model.config)
    torch.save({**state, "hydra_mlp.0.9.bias": torch.zeros(1)}, weights)
    with pytest.raises(HeadsError, match=rf"{where}: key mismatch: unexpected 1 key"):
        load_heads(d, model.config)
    torch.save({f"hydra_head.{k}": v for k, v in state.items()}, weights)  # a whole HydraModel's state dict
    with pytest.raises(HeadsError, match=rf"{where}: no hydra_mlp.<head>.<block>.linear.weight keys"):
        load_heads(d, model.config)
    torch.save(state, weights)
    (d / "config.json").write_text(json.dumps(hydra_config(4, 1, "prefix-mlp")))
    with pytest.raises(HeadsError, match=rf"{where}: config.json says hydra_head_arch 'prefix-mlp' but the file has no prefix layer"):
        load_heads(d, model.config)
    (d / "config.json").write_text(json.dumps(hydra_config(4, 1, "cross-attn")))
    with pytest.raises(HeadsError, match=rf"{re.escape(str(d / 'config.json'))}: hydra_head_arch 'cross-attn' is not supported"):
        load_heads(d, model.config)
    m, _ = official_medusa(model, tmp_path)
    torch.save({"medusa_head.0.0.linear.weight": torch.zeros(2, 2)}, m / "medusa_lm_head.pt")
    where = re.escape(str(m / "medusa_lm_head.pt"))
    with pytest.raises(HeadsError, match=rf"{where}: no <head>.<block>.linear.weight keys: no Medusa heads"):
        load_heads(m, model.config)


def test_whole_models_are_refused(model, tmp_path):
    d = tmp_path / "medusa2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**model.config.to_dict(), "medusa_num_heads": 3, "medusa_num_layers": 1}))
    (d / "model.safetensors").write_bytes(b"")
    where = re.escape(str(d / "config.json"))
    with pytest.raises(HeadsError, match=rf"{where}: a Medusa-2 model \(model.safetensors holds base weights"):
        load_heads(d, model.config)
    (d / "config.json").write_text(json.dumps(model.config.to_dict()))
    with pytest.raises(HeadsError, match=rf"{where}: a whole model \(model.safetensors\), not draft heads"):
        load_heads(d, model.config)


def test_heads_that_do_not_fit_the_model(model, tmp_path):
    wide = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "hidden_size": 64, "intermediate_size": 64}))
    d, _ = official_hydra(wide, tmp_path)
    with pytest.raises(HeadsError, match="shape"):
        load_heads(d, model.config)
    save_heads(random_heads(model), tmp_path / "ours")
    other = LlamaConfig(**{**model.config.to_dict(), "vocab_size": 99})
    with pytest.raises(HeadsError, match="vocabulary 48, the model has 99"):
        load_heads(tmp_path / "ours", model.config).bind(LlamaForCausalLM(other))


def test_our_format_round_trip(model, prompts, tmp_path):
    for kind, kw in (("hydra", {}), ("hydra", {"arch": "prefix-mlp"}), ("medusa", {})):
        heads = random_heads(model, kind, **kw)
        heads.set_draft_vocab(torch.arange(40))
        save_heads(heads, tmp_path / kind, {"note": "test"})
        back = load_heads(tmp_path / kind, model.config).bind(model)
        assert back.config_dict() == heads.config_dict()
        assert torch.equal(back.draft_vocab, torch.arange(40))
        assert back.provenance["note"] == "test" and back.provenance["sha256"]
        for k, t in heads.state_dict().items():
            assert torch.equal(back.state_dict()[k], t), k
        a = run(model, prompts[0], TREE, heads)
        b = run(model, prompts[0], TREE, back)
        assert a.token_ids == b.token_ids and [r.draft_tokens for r in a.steps] == [r.draft_tokens for r in b.steps]


def test_missing_or_unknown_layouts(model, tmp_path):
    with pytest.raises(HeadsError, match="not found"):
        load_heads(tmp_path / "nope", model.config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadsError, match="no heads.json"):
        load_heads(tmp_path / "empty", model.config)
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(HeadsError, match="neither hydra_num_heads nor medusa_num_heads"):
        load_heads(tmp_path / "empty", model.config)


# -- hub fetches: only config and head files, whole models refused before any download ---------


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A hub of named repos (file name -> JSON text or None); records what was downloaded."""
    repos, downloads = {}, []

    def list_repo_files(repo_id, revision=None):
        if repo_id not in repos:
            raise OSError(f"404 Client Error: {repo_id} not found")  # the hub's HTTP errors are OSErrors
        return list(repos[repo_id])

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        downloads.append((repo_id, sorted(allow_patterns)))
        return str(tmp_path)

    def hf_hub_download(repo_id, filename, revision=None):
        downloads.append((repo_id, [filename]))
        out = tmp_path / f"{repo_id.replace('/', '--')}-{filename}"
        out.write_text(repos[repo_id][filename])
        return str(out)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for fn in (list_repo_files, snapshot_download, hf_hub_download):
        monkeypatch.setattr(huggingface_hub, fn.__name__, fn)
    return repos, downloads


def test_hub_fetch_takes_only_head_files(fake_hub, tmp_path):
    repos, downloads = fake_hub
    repos["a/hydra"] = {"config.json": None, "hydra_lm_head.pt": None, "README.md": None, ".gitattributes": None}
    repos["a/medusa"] = {"config.json": None, "medusa_lm_head.safetensors": None, "medusa_lm_head.pt": None}
    repos["a/ours"] = {"heads.json": None, "heads.safetensors": None, "config.json": None}
    for repo in repos:
        assert fetch_hub_heads(repo) == tmp_path
    assert downloads == [
        ("a/hydra", ["config.json", "hydra_lm_head.pt"]),
        ("a/medusa", ["config.json", "medusa_lm_head.safetensors"]),
        ("a/ours", ["heads.json", "heads.safetensors"]),
    ]


def test_hub_fetch_refuses_whole_models_before_downloading_them(fake_hub):
    repos, downloads = fake_hub
    shards = {"model-00001-of-00002.safetensors": None, "model-00002-of-00002.safetensors": None, "model.safetensors.index.json": None}
    repos["f/medusa-2"] = {"config.json": json.dumps({"model_type": "llama", "medusa_num_heads": 3}), **shards}
    repos["f/llama"] = {"config.json": json.dumps({"model_type": "llama"}), "pytorch_model.bin": None}
    repos["f/other"] = {"README.md": None, "adapter_model.safetensors": None}
    with pytest.raises(HeadsError, match=r"hub repo f/medusa-2: a Medusa-2 model .* in model-00001-of-00002.safetensors, not draft"):
        fetch_hub_heads("f/medusa-2")
    with pytest.raises(HeadsError, match=r"hub repo f/llama: a whole model in pytorch_model.bin, not draft heads"):
        fetch_hub_heads("f/llama")
    with pytest.raises(HeadsError, match="hub repo f/other: no draft-head files"):
        fetch_hub_heads("f/other")
    with pytest.raises(HeadsError, match="hub repo f/missing: cannot list its files: 404"):
        fetch_hub_heads("f/missing")
    assert downloads == [("f/medusa-2", ["config.json"]), ("f/llama", ["config.json"])]  # configs only


def test_resolve_heads_fetches_through_the_filter(fake_hub, model, tmp_path, monkeypatch):
    from entmtp.runtime.runtime import resolve_heads

    repos, downloads = fake_hub
    d, _ = official_hydra(model, tmp_path / "snap")
    repos["a/hydra"] = {"config.json": None, "hydra_lm_head.pt": None, "pytorch_model.bin": None}
    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        downloads.append(allow_patterns)
        return str(d)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    heads = resolve_heads(model, "tiny", "hydra", "a/hydra")
    assert heads.kind == "hydra" and downloads == [["config.json", "hydra_lm_head.pt"]]
