"""Our heads format and the official Hydra / Medusa layouts (written here at tiny size, key by key)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaModel

from entmtp.config import TREES_FILE
from entmtp.heads import HeadsError, load_heads, save_heads
from entmtp.topology import load_named_trees
from conftest import random_heads
from test_engine import reference, run

TREE = load_named_trees(TREES_FILE)["mc_sim_7b_63"]


def _rand(*shape):
    return torch.randn(*shape) * 0.3


def official_hydra_state(cfg, num_heads, num_layers, arch):
    """The exact key layout of zankner/Hydra's hydra_lm_head.pt."""
    h, v = cfg.hidden_size, cfg.vocab_size
    prefix = arch == "prefix-mlp"
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            idx = 2 * j + 1 if prefix else j  # prefix-mlp puts a Dropout before every block
            width = (i + 2) * h if j == 0 else h
            state[f"hydra_mlp.{i}.{idx}.linear.weight"] = _rand(h, width)
            state[f"hydra_mlp.{i}.{idx}.linear.bias"] = _rand(h)
            if j == 0:
                state[f"hydra_mlp.{i}.{idx}.res_connection.weight"] = _rand(h, width)
                state[f"hydra_mlp.{i}.{idx}.res_connection.bias"] = _rand(h)
        lm = f"hydra_lm_head.{i}.1" if prefix else f"hydra_lm_head.{i}"
        state[f"{lm}.weight"] = _rand(v, h)
        state[f"{lm}.bias"] = _rand(v)
    if prefix:
        one = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
        for k, t in LlamaModel(one).state_dict().items():
            state[f"prefix_embeding_layer.{k}"] = _rand(*t.shape)
    return state


def write_hydra(tmp_path, cfg, arch="mlp", num_heads=4, num_layers=1, state=None):
    d = tmp_path / f"hydra-{arch}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "base_model_name_or_path": "tiny",
                "hydra_num_heads": num_heads,
                "hydra_num_layers": num_layers,
                "hydra_head_arch": arch,
                "grounded_heads": True,
                "hidden_state_offset": 0,
            }
        )
    )
    torch.save(state if state is not None else official_hydra_state(cfg, num_heads, num_layers, arch), d / "hydra_lm_head.pt")
    return d


def write_medusa(tmp_path, cfg, num_heads=4, num_layers=1, fmt="pt"):
    h, v = cfg.hidden_size, cfg.vocab_size
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"{i}.{j}.linear.weight"] = _rand(h, h)
            state[f"{i}.{j}.linear.bias"] = _rand(h)
        state[f"{i}.{num_layers}.weight"] = _rand(v, h)
    d = tmp_path / f"medusa-{fmt}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers}))
    if fmt == "pt":
        torch.save(state, d / "medusa_lm_head.pt")
    else:
        save_file(state, str(d / "medusa_lm_head.safetensors"))
    return d


@pytest.mark.parametrize("arch, layers", [("mlp", 1), ("mlp", 2), ("prefix-mlp", 1), ("prefix-mlp", 2)])
def test_official_hydra_layout_loads_and_decodes(model, prompts, tmp_path, arch, layers):
    torch.manual_seed(0)
    d = write_hydra(tmp_path, model.config, arch, num_layers=layers)
    heads = load_heads(d, model.config).bind(model)
    assert heads.kind == "hydra" and heads.arch == arch and not heads.shared_lm_head
    for prompt in prompts:
        assert run(model, prompt, TREE, heads).token_ids == reference(model, prompt, 30)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_official_medusa_layout_loads_and_decodes(model, prompts, tmp_path, fmt):
    torch.manual_seed(0)
    heads = load_heads(write_medusa(tmp_path, model.config, fmt=fmt), model.config).bind(model)
    assert heads.kind == "medusa"
    for prompt in prompts:
        assert run(model, prompt, TREE, heads).token_ids == reference(model, prompt, 30)


def test_loaded_weights_are_the_written_ones(model, tmp_path):
    torch.manual_seed(0)
    state = official_hydra_state(model.config, 4, 1, "mlp")
    heads = load_heads(write_hydra(tmp_path, model.config, state=state), model.config)
    mine = heads.state_dict()
    assert set(mine) == set(state)
    for k in state:
        assert torch.equal(mine[k], state[k])


def test_key_mismatch_is_a_clear_error(model, tmp_path):
    state = official_hydra_state(model.config, 4, 1, "mlp")
    missing = dict(state)
    missing.pop("hydra_mlp.2.0.res_connection.bias")
    with pytest.raises(HeadsError, match=r"key mismatch: missing 1 key\(s\).*hydra_mlp.2.0.res_connection.bias"):
        load_heads(write_hydra(tmp_path, model.config, state=missing), model.config)
    extra = {**state, "hydra_mlp.0.9.linear.weight": torch.zeros(1)}
    with pytest.raises(HeadsError, match="unexpected 1 key"):
        load_heads(write_hydra(tmp_path, model.config, state=extra), model.config)
    # the layout says prefix-mlp but the file holds plain mlp keys
    with pytest.raises(HeadsError, match="key mismatch"):
        load_heads(write_hydra(tmp_path, model.config, arch="prefix-mlp", state=state), model.config)


def test_heads_that_do_not_fit_the_model(model, tmp_path):
    wide = LlamaConfig(**{**model.config.to_dict(), "hidden_size": 64, "intermediate_size": 64})
    d = write_hydra(tmp_path, wide)
    with pytest.raises(HeadsError, match="shape"):
        load_heads(d, model.config)
    ours = random_heads(model)
    save_heads(ours, tmp_path / "ours")
    other = LlamaConfig(**{**model.config.to_dict(), "vocab_size": 99})
    from transformers import LlamaForCausalLM

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
