"""PEFT LoRA adapters as agents, against PEFT itself: its get_delta_weight() and its merge_and_unload().

The adapters are made by PEFT with ``init_lora_weights=False`` (A and B random, so B·A ≠ 0), then B is scaled
down so that τ has the size of a few RL steps. The full-model oracle is PEFT's merge_and_unload() on the base
loaded in float32 and saved in float32: θ_t = fl32(W + τ_t). Merging those folders computes τ_t = θ_t − W in
float32, which differs from the adapter's exact τ_t by the rounding of W + τ_t (half an fp32 ulp of |W| + |τ|)
plus the matmul's summation order; merging from the adapters never rounds τ. Hence the tolerance below: a few
fp32 ulps of the largest |θ| in the tensor, per agent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlmerge
from conftest import TINY, assert_same_tensors, load_output, numba_route
from rlmerge.engine.dryrun import dry_run
from rlmerge.errors import InputError, RLMergeError
from rlmerge.io.open import open_all
from rlmerge.stream.fast import eligible
from rlmerge.stream.match import match_models
from rlmerge.synthetic import make_example

peft = pytest.importorskip("peft", reason="peft is in the lora extra (make setup installs it)")
transformers = pytest.importorskip("transformers")

ULPS = 8  # fp32 ulps of max|θ| per tensor: rounding W + τ once, the subtraction, summation order, N agents


def _adapter(base: Path, out: Path, seed: int, **cfg: object) -> Path:
    """A real PEFT adapter over ``base`` with non-zero B (init_lora_weights=False), B scaled to RL-step size."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **cfg))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.mul_(1e-2)
            elif "modules_to_save" in name or ("bias" in name and p.requires_grad):
                p.add_(1e-3 * torch.randn_like(p))
    pm.save_pretrained(out)
    return out


def _full(base: Path, adapter: Path, out: Path) -> Path:
    """PEFT's own merge: merge_and_unload() on the float32 base, saved as a full float32 model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[Path]]:
    root = tmp_path_factory.mktemp("lora")
    base, _ = make_example(root / "in", shape=TINY, densities=())
    adapters = [
        _adapter(base, root / "a0", 0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "embed_tokens"],
                 modules_to_save=["model.norm"], rank_pattern={"layers.1.self_attn.q_proj": 2},
                 alpha_pattern={"v_proj": 3}),
        _adapter(base, root / "a1", 1, r=8, lora_alpha=16, use_rslora=True, bias="lora_only",
                 target_modules=["q_proj", "k_proj", "gate_proj", "down_proj"]),
    ]
    fulls = [_full(base, a, root / f"full{t}") for t, a in enumerate(adapters)]
    return base, adapters, fulls


def test_delta_equals_peft_get_delta_weight_at_any_block_size(lora) -> None:
    base, adapters, _ = lora
    ckpts = open_all([base, *adapters])
    match_models(ckpts[0], ckpts[1:])
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, adapters[0])
    checked = 0
    for mod_name, module in pm.base_model.model.named_modules():
        if not hasattr(module, "get_delta_weight") or "default" not in getattr(module, "scaling", {}):
            continue
        ref = module.get_delta_weight("default").reshape(-1)
        name = mod_name + ".weight"
        info = ckpts[0].tensors[name]
        b = ckpts[0].read_f32(name, 0, info.numel, torch.empty(info.numel))
        whole = ckpts[1].read_delta_f32(name, 0, info.numel, b, torch.empty(info.numel)).clone()
        torch.testing.assert_close(whole, ref, rtol=0, atol=ULPS * 2**-23 * ref.abs().max().item())
        pieces = torch.cat([ckpts[1].read_delta_f32(name, s, min(s + 37, info.numel), b[s:], torch.empty(37))
                            for s in range(0, info.numel, 37)])
        assert torch.equal(pieces, whole), name  # the block size never changes a value
        checked += 1
    assert checked == len(ckpts[1]._modules) == 7  # q, v, o in 2 layers + the embedding
    # the note's share counts what it names: the adapted matrices and the tensors saved whole (model.norm)
    floats = sum(i.numel for i in ckpts[0].tensors.values() if i.is_float)
    share = sum(ckpts[0].tensors[n].numel for n in [*ckpts[1]._modules, "model.norm.weight"]) / floats
    assert sorted(ckpts[1]._full) == ["model.embed_tokens.weight", "model.norm.weight"]  # the embedding: also adapted
    assert any(f"in the 7 adapted matrices and 1 tensor(s) it saves whole (modules_to_save, trained biases) "
               f"({share:.1%} of the base's float elements" in n for n in ckpts[1].notes), ckpts[1].notes
    assert ckpts[1]._modules["model.layers.1.self_attn.q_proj.weight"].scale == 8 / 2  # rank_pattern
    assert ckpts[1]._modules["model.layers.0.self_attn.v_proj.weight"].scale == 3 / 4  # alpha_pattern
    assert ckpts[2]._modules["model.layers.0.mlp.down_proj.weight"].scale == 16 / 8**0.5  # rsLoRA


@pytest.mark.parametrize("method", ["task_arithmetic", "ram"])
def test_merge_from_adapters_matches_merge_of_peft_merged_models(lora, tmp_path: Path, method: str) -> None:
    base, adapters, fulls = lora
    params = {"scaling": 1.0} if method == "task_arithmetic" else None
    rlmerge.merge(base, adapters, tmp_path / "from-adapters", method=method, params=params, dtype="float32")
    rlmerge.merge(base, fulls, tmp_path / "from-full", method=method, params=params, dtype="float32")
    got, ref = load_output(tmp_path / "from-adapters"), load_output(tmp_path / "from-full")
    assert got.keys() == ref.keys()
    for name in ref:
        tol = ULPS * 2**-23 * ref[name].abs().max().item()
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=tol, msg=name)
    changed = [n for n in ref if not torch.equal(ref[n], load_output(base)[n].float())]
    assert "model.norm.weight" in changed and "model.embed_tokens.weight" in changed  # modules_to_save, embedding
    assert "model.layers.0.self_attn.q_proj.bias" in changed  # bias="lora_only" trains the biases


def test_an_embedding_adapted_and_saved_whole_takes_both(lora, tmp_path: Path) -> None:
    """LoRA on embed_tokens makes PEFT save the embedding's base layer whole too (save_embedding_layers); PEFT loads
    that tensor as the layer's weight and adds the LoRA product on top. With the saved tensor trained (≠ the base's),
    τ must be (F − W) + s·B·A, as PEFT's own merge_and_unload gives, not either term alone."""
    from safetensors.torch import load_file, save_file

    base = lora[0]
    adapter = _adapter(base, tmp_path / "emb", 2, r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    weights = adapter / "adapter_model.safetensors"
    stored = load_file(weights)
    (key,) = [k for k in stored if k.endswith("embed_tokens.base_layer.weight")]
    torch.manual_seed(3)
    stored[key] = stored[key] + 1e-2 * torch.randn_like(stored[key])  # the saved layer itself trained
    save_file(stored, str(weights), metadata={"format": "pt"})
    full = _full(base, adapter, tmp_path / "full")
    for agent, out in ((adapter, "from-adapter"), (full, "from-full")):
        rlmerge.merge(base, [agent], tmp_path / out, method="task_arithmetic", params={"scaling": 1.0},
                      dtype="float32")
    got, ref = load_output(tmp_path / "from-adapter"), load_output(tmp_path / "from-full")
    name = "model.embed_tokens.weight"
    w = load_output(base)[name].float()
    tol = ULPS * 2**-23 * ref[name].abs().max().item()
    torch.testing.assert_close(got[name], ref[name], rtol=0, atol=tol)
    product = ref[name] - (stored[key] - w) - w  # PEFT's LoRA term alone
    assert (ref[name] - w - product).abs().max() > 100 * tol and product.abs().max() > 100 * tol  # both terms count


def test_block_size_and_fast_path(lora, tmp_path: Path) -> None:
    base, adapters, _ = lora
    rlmerge.merge(base, adapters, tmp_path / "a", method="ram+", block_size=64)
    rlmerge.merge(base, adapters, tmp_path / "b", method="ram+", block_size=1 << 20)
    a, b = load_output(tmp_path / "a"), load_output(tmp_path / "b")
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    ckpts = open_all([base, *adapters])
    plan = match_models(ckpts[0], ckpts[1:])
    assert any(eligible(plan, j) for j in plan.jobs)  # every kernel takes the agents as their τ
    fast, merged = numba_route(base, adapters, "ties")
    assert fast == merged and merged


@pytest.mark.parametrize(("method", "params"), [
    ("ram+", None), ("ram", None), ("task_arithmetic", {"scaling": 0.7}), ("model_stock", None),
    ("ram+", {"preset": "arm-r"}), ("ties", {"density": 0.3}), ("ties_global", {"density": 0.3}),
    ("breadcrumbs_ties", {"density": 0.8, "gamma": 0.05}), ("dare_ties", {"density": 0.5}),
    ("dare_ta", {"density": 0.5, "rescale": "l1"}), ("della", {"density": 0.6, "epsilon": 0.1}),
    ("della_linear", {"density": 0.6, "epsilon": 0.1, "rescale": "l1"})])
@pytest.mark.parametrize("mix", ["adapters", "adapter+full"])
def test_adapters_on_the_numba_path_write_the_torch_paths_bytes(lora, tmp_path: Path, monkeypatch, method: str,
                                                               params: dict | None, mix: str) -> None:
    # Every kernel takes the agents as τ when one is an adapter: every agent's τ as the torch path computes it.
    base, adapters, fulls = lora
    agents = adapters if mix == "adapters" else [adapters[0], fulls[1]]
    fast, merged = numba_route(base, agents, method, params=params)
    assert fast == merged and merged
    kw = {"method": method, "params": params, "dtype": "bfloat16"}
    plan = dry_run(base, agents, tmp_path / "numba", block_size=3000, **kw)
    res = rlmerge.merge(base, agents, tmp_path / "numba", block_size=3000, **kw)
    assert (res.passes, res.read_bytes) == (plan.passes, plan.read_bytes)  # plan says what the merge reads
    monkeypatch.setenv("RLMERGE_FAST", "0")
    rlmerge.merge(base, agents, tmp_path / "torch", **kw)
    assert_same_tensors(load_output(tmp_path / "numba"), load_output(tmp_path / "torch"))


@pytest.mark.parametrize("gather", [True, False])
def test_ties_exact_k_on_adapter_tau_writes_the_torch_paths_bytes(lora, tmp_path: Path, monkeypatch,
                                                                  gather: bool) -> None:
    """TIES keeps exactly k per tensor, cutting the ties at its threshold in flat order; on the numba path the cut
    is found from the agents' τ as the blocks hold them: from the gathered bins, or (no room to gather) by a scan
    while merging. An adapter whose factors are small multiples of 2^-6 has τ = s·B·A on a coarse grid: many |τ|
    equal the threshold."""
    from safetensors.torch import load_file, save_file

    from rlmerge.methods.sparsify import fast_select

    base, adapters, _ = lora
    coarse = tmp_path / "coarse"
    coarse.mkdir()
    (coarse / "adapter_config.json").write_bytes((adapters[0] / "adapter_config.json").read_bytes())
    factors = load_file(adapters[0] / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({k: (torch.randint(-1, 2, v.shape, generator=g).float() * 2**-6 if "lora_" in k else v)
               for k, v in factors.items()}, coarse / "adapter_model.safetensors")
    agents = [coarse, adapters[1]]
    assert numba_route(base, agents, "ties")[0]
    feeds = []
    if gather:
        real = fast_select.kernels.gather_bin
        monkeypatch.setattr(fast_select.kernels, "gather_bin", lambda *a: feeds.append(a[-1]) or real(*a))
    else:
        monkeypatch.setattr(fast_select, "GATHER", 0)
        real = fast_select._feed_cut
        monkeypatch.setattr(fast_select, "_feed_cut", lambda *a: feeds.append(a[0].tau) or real(*a))
    kw = {"method": "ties", "params": {"density": 0.3}, "dtype": "bfloat16", "block_size": 3000}
    rlmerge.merge(base, agents, tmp_path / "numba", **kw)
    assert feeds and all(feeds)  # ties at a threshold were cut, from τ
    monkeypatch.setenv("RLMERGE_FAST", "0")
    rlmerge.merge(base, agents, tmp_path / "torch", **kw)
    assert_same_tensors(load_output(tmp_path / "numba"), load_output(tmp_path / "torch"))


def test_inspect_and_plan_say_lora_tau_is_dense(lora, tmp_path: Path) -> None:
    base, adapters, _ = lora
    rep = rlmerge.inspect(base, adapters)
    notes = [w for w in rep.doc["warnings"] if "LoRA adapter" in w]
    assert len(notes) == 2 and all("dense by construction" in w and "task_arithmetic" in w for w in notes)
    dry = dry_run(base, adapters, tmp_path / "out")  # `rlmerge plan` opens the inputs the same way
    assert dry.ok and any("LoRA adapter" in w for w in dry.warnings)


def test_adapter_bin_as_openrlhf_zero3_saves_it(lora, tmp_path: Path) -> None:
    """OpenRLHF under ZeRO-3 writes adapter_model.bin (torch.save of the PEFT state dict) and removes the
    .safetensors; the same adapter read either way gives the same merge."""
    from safetensors.torch import load_file

    base, adapters, _ = lora
    alt = tmp_path / "a0-bin"
    alt.mkdir()
    (alt / "adapter_config.json").write_bytes((adapters[0] / "adapter_config.json").read_bytes())
    torch.save(load_file(adapters[0] / "adapter_model.safetensors"), alt / "adapter_model.bin")
    rlmerge.merge(base, [alt, adapters[1]], tmp_path / "bin", method="ram")
    rlmerge.merge(base, adapters, tmp_path / "st", method="ram")
    x, y = load_output(tmp_path / "bin"), load_output(tmp_path / "st")
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_fan_in_fan_out_gpt2(tmp_path: Path) -> None:
    """GPT-2's Conv1D stores W as [in, out]; PEFT sets fan_in_fan_out and τ = (B·A)ᵀ."""
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "base")
    ad = _adapter(tmp_path / "base", tmp_path / "ad", 3, r=4, lora_alpha=4, target_modules=["c_attn"],
                  fan_in_fan_out=True)
    full = _full(tmp_path / "base", ad, tmp_path / "full")
    rlmerge.merge(tmp_path / "base", [ad], tmp_path / "x", method="task_arithmetic", dtype="float32")
    rlmerge.merge(tmp_path / "base", [full], tmp_path / "y", method="task_arithmetic", dtype="float32")
    x, y = load_output(tmp_path / "x"), load_output(tmp_path / "y")
    name = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(y[name], load_output(tmp_path / "base")[name])
    for k in y:
        torch.testing.assert_close(x[k], y[k], rtol=0, atol=ULPS * 2**-23 * y[k].abs().max().item())


def _set_fan_in_fan_out(adapter: Path, value: bool) -> None:
    """What a converter or a hand edit leaves: PEFT itself saves the flag its layers forced (it mutates its config)."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["fan_in_fan_out"] = value
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))


def _assert_merges_like_peft(base: Path, adapter: Path, tmp_path: Path, changed: list[str]) -> None:
    """rlmerge's merge of ``adapter`` equals the merge of PEFT's merge_and_unload() of it (loaded as PEFT loads it)."""
    with pytest.warns(UserWarning, match="fan_in_fan_out is set to"):  # PEFT says it overrides the flag
        full = _full(base, adapter, tmp_path / "full")
    rlmerge.merge(base, [adapter], tmp_path / "x", method="task_arithmetic", dtype="float32")
    rlmerge.merge(base, [full], tmp_path / "y", method="task_arithmetic", dtype="float32")
    x, y, b = load_output(tmp_path / "x"), load_output(tmp_path / "y"), load_output(base)
    for name in changed:
        assert not torch.equal(y[name], b[name].float()), name
    for k in y:
        torch.testing.assert_close(x[k], y[k], rtol=0, atol=ULPS * 2**-23 * y[k].abs().max().item(), msg=k)


def test_fan_in_fan_out_true_on_linear_layers_is_ignored_as_peft_ignores_it(lora, tmp_path: Path) -> None:
    """Qwen2's q/o projections are square nn.Linear layers: PEFT warns and merges W + s·B@A whatever the flag
    says; rlmerge merged W + s·(B@A)ᵀ (and refused k/v, whose transpose has the wrong shape)."""
    base, _, _ = lora
    ad = _adapter(base, tmp_path / "ad", 5, r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "k_proj"])
    _set_fan_in_fan_out(ad, True)
    _assert_merges_like_peft(base, ad, tmp_path, ["model.layers.0.self_attn.q_proj.weight",
                                                  "model.layers.1.self_attn.o_proj.weight",
                                                  "model.layers.0.self_attn.k_proj.weight"])
    notes = [w for w in dry_run(base, [ad], tmp_path / "plan").warnings if "fan_in_fan_out" in w]
    assert notes and "Linear" in notes[0]  # PEFT's warning, said too


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2: Conv1D layers (W stored [in, out]), the attention's c_proj square."""
    root = tmp_path_factory.mktemp("gpt2")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(root / "base")
    return root / "base"


def test_fan_in_fan_out_false_on_conv1d_layers_is_overridden_as_peft_overrides_it(gpt2: Path, tmp_path: Path) -> None:
    """GPT-2's Conv1D layers need τ = s·(B@A)ᵀ even where adapter_config.json says fan_in_fan_out: false (PEFT warns
    and sets it): rlmerge merged the square attn.c_proj untransposed and refused c_fc."""
    ad = _adapter(gpt2, tmp_path / "ad", 4, r=2, lora_alpha=4, target_modules=["c_attn", "c_proj", "c_fc"],
                  fan_in_fan_out=True)
    _set_fan_in_fan_out(ad, False)
    _assert_merges_like_peft(gpt2, ad, tmp_path, ["transformer.h.0.attn.c_proj.weight",
                                                  "transformer.h.0.mlp.c_fc.weight",
                                                  "transformer.h.0.attn.c_attn.weight"])


@pytest.mark.parametrize("config", ["no model_type", "custom code (auto_map)"])
def test_a_square_layer_of_unknown_class_is_refused_not_guessed(gpt2: Path, tmp_path: Path, config: str) -> None:
    """Without a transformers model_type nothing says whether a square W is a Linear or a Conv1D: refused, naming the
    tensor; a non-square one is decided by its shape (c_attn [16, 48] is only a Conv1D's)."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(gpt2, base)
    cfg = json.loads((base / "config.json").read_text())
    if config == "no model_type":
        del cfg["model_type"]
    else:
        cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomGPT"}
    (base / "config.json").write_text(json.dumps(cfg))
    square = _adapter(gpt2, tmp_path / "square", 4, r=2, target_modules=["c_proj"], fan_in_fan_out=True)
    with pytest.raises(RLMergeError, match="cannot tell whether transformer.h.0.attn.c_proj is a Linear") as info:
        rlmerge.merge(base, [square], tmp_path / "out")
    assert "transformer.h.0.attn.c_proj.weight" in info.value.render() and not (tmp_path / "out").exists()
    wide = _adapter(gpt2, tmp_path / "wide", 4, r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    rlmerge.merge(base, [wide], tmp_path / "x", method="task_arithmetic", dtype="float32")
    rlmerge.merge(gpt2, [wide], tmp_path / "y", method="task_arithmetic", dtype="float32")
    assert_same_tensors(load_output(tmp_path / "x"), load_output(tmp_path / "y"))


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(("change", "match"), [
    ({"use_dora": True}, "DoRA"),
    ({"lora_alpha": 0}, "placeholder"),
    ({"init_lora_weights": "pissa_niter_4"}, "rewrote the base weights"),
    ({"layer_replication": [[0, 1]]}, "layer_replication"),
    ({"r": 5}, "rank 5"),
    ({"peft_type": "IA3"}, "LoRA adapters only"),
])
def test_inexact_adapters_are_refused(lora, tmp_path: Path, change: dict, match: str) -> None:
    base, adapters, _ = lora
    bad = _edit_config(adapters[0], tmp_path / "bad", **change)
    with pytest.raises(RLMergeError, match=match) as info:  # several problems come as one ProblemsError
        rlmerge.merge(base, [bad], tmp_path / "out")
    first = getattr(info.value, "problems", [info.value])[0]
    assert isinstance(first, InputError) and first.hint and not (tmp_path / "out").exists()


def _rank_zero(src: Path, dst: Path) -> Path:
    """layers.0's q_proj of rank 0 (A [0, in], B [out, 0]) and rank_pattern saying so: α/r divided by zero."""
    from safetensors.torch import load_file, save_file

    bad = _edit_config(src, dst, rank_pattern={"layers.0.self_attn.q_proj": 0})
    state = load_file(bad / "adapter_model.safetensors")
    for k in [k for k in state if "layers.0.self_attn.q_proj.lora_" in k]:
        shape = list(state[k].shape)
        shape["lora_A" in k and 0 or 1] = 0
        state[k] = torch.empty(shape)
    save_file(state, bad / "adapter_model.safetensors")
    return bad


PATTERNS = [  # (case, what the message says, adapter_config.json changes; None: rank 0 in the weights too)
    ("a pattern that is no regex", "'q_proj(' is not a regular expression", {"rank_pattern": {"q_proj(": 2}}),
    ("a rank that is text", "rank_pattern['q_proj'] = 'two'", {"rank_pattern": {"q_proj": "two"}}),
    ("a rank that is a list", "rank_pattern['q_proj'] = [2]", {"rank_pattern": {"q_proj": [2]}}),
    ("a fractional rank", "rank_pattern['q_proj'] = 2.5", {"rank_pattern": {"q_proj": 2.5}}),
    ("an alpha that is text", "alpha_pattern['v_proj'] = 'x'", {"alpha_pattern": {"v_proj": "x"}}),
    ("an alpha that is a list", "alpha_pattern['v_proj'] = [3]", {"alpha_pattern": {"v_proj": [3]}}),
    ("patterns that are a list", "rank_pattern is a list", {"rank_pattern": ["q_proj"]}),
    ("rank 0 in rank_pattern", "rank_pattern['layers.0.self_attn.q_proj'] = 0", None),
    # beyond the issue: a NaN alpha merged to NaN (found only by the merge, after plan passed); a boolean rank
    ("a NaN lora_alpha", "lora_alpha = nan is not a non-zero number", {"lora_alpha": float("nan")}),
    ("an infinite alpha in alpha_pattern", "alpha_pattern['v_proj'] = inf", {"alpha_pattern": {"v_proj": 1e999}}),
    ("a boolean rank", "rank_pattern['q_proj'] = True", {"rank_pattern": {"q_proj": True}}),
]


@pytest.mark.parametrize(("case", "needle", "changes"), PATTERNS, ids=[c[0] for c in PATTERNS])
@pytest.mark.parametrize("command", ["merge", "plan"])
def test_malformed_rank_and_alpha_patterns_are_typed_errors(lora, tmp_path: Path, capsys, command: str, case: str,
                                                            needle: str, changes: dict | None) -> None:
    """A bad regex, a non-numeric or list value, rank 0 in rank_pattern / alpha_pattern: tracebacks (re.error,
    ValueError, TypeError, ZeroDivisionError) before; now an InputError naming the file and the key, exit 3."""
    from rlmerge.cli import main

    base, adapters, _ = lora
    bad = tmp_path / "bad"
    if changes is None:
        _rank_zero(adapters[0], bad)
    else:
        _edit_config(adapters[0], bad, **changes)
    rc = main([command, str(base), str(bad), "-o", str(tmp_path / "out"), *(["-q"] if command == "merge" else [])])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert needle in err and str(bad / "adapter_config.json") in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_lm_head_lora_on_a_tied_base_is_refused(lora, tmp_path: Path) -> None:
    base, _, _ = lora
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    pm.save_pretrained(tmp_path / "head")
    with pytest.raises(InputError, match="ties to its embeddings") as info:
        rlmerge.merge(base, [tmp_path / "head"], tmp_path / "out")
    assert info.value.tensor == "lm_head.weight"


def test_adapter_as_base_is_refused(lora, tmp_path: Path) -> None:
    base, adapters, _ = lora
    with pytest.raises(RLMergeError, match="base is a LoRA adapter"):
        rlmerge.merge(adapters[0], [base], tmp_path / "out")


def test_cli_plan_and_inspect_accept_adapters(lora, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlmerge.cli import main

    base, adapters, _ = lora
    assert main(["plan", str(base), *map(str, adapters), "-o", str(tmp_path / "out")]) == 0
    assert "LoRA adapter" in capsys.readouterr().err.replace("\n", "")
    assert main(["inspect", str(base), *map(str, adapters), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["agent"] for r in doc["per_agent"]] == [str(a) for a in adapters]
    assert all(r["density"] > 0.1 for r in doc["per_agent"])  # B·A is dense in every adapted matrix


def test_resume_fingerprint_covers_the_adapter_config(lora, tmp_path: Path) -> None:
    from rlmerge.io.partial import fingerprint

    base, adapters, _ = lora
    ad = _edit_config(adapters[0], tmp_path / "ad")
    before = fingerprint(open_all([base, ad]), {})
    cfg = (ad / "adapter_config.json").read_text()
    (ad / "adapter_config.json").write_text(cfg.replace('"lora_alpha": 8', '"lora_alpha": 9'))  # same size
    assert '"lora_alpha": 9' in (ad / "adapter_config.json").read_text()
    assert fingerprint(open_all([base, ad]), {}) != before
