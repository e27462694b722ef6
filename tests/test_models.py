"""Tests of adaflash_ray.models: the target against transformers (real SmolLM2 and tiny Qwen2/Qwen3),
feature capture and the KV cache, the drafter (training vs inference attention), the length head,
DFlash checkpoints and the engine's refusal of drafters that do not fit.

Run: python -m pytest -q tests/test_models.py   (CPU, ~15 s; loads SmolLM2-135M twice: ours and HF's)
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import encode_chat, make_drafter, make_tiny_target

from adaflash_ray.config import default_target_layer_ids as config_default_layer_ids
from adaflash_ray.engine import SamplingParams, SpecEngine
from adaflash_ray.models.checkpoint import (CheckpointError, load_drafter_checkpoint, save_drafter_checkpoint,
                                            tensors_sha256)
from adaflash_ray.models.drafter import DrafterModelConfig
from adaflash_ray.models.factory import build_drafter
from adaflash_ray.models.length_head import DirectLengthHead, direct_length_label, ratio_to_draft_len
from adaflash_ray.models.target import TargetModel, default_target_layer_ids


# ----------------------------------------------------------------------------------- target vs transformers
@pytest.fixture(scope="module")
def hf_real(real_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


def test_real_target_matches_transformers(real_target, hf_real, tokenizer):
    """Logits, the captured layers (HF hidden_states[i+1]) and the final hidden state agree on chat prompts."""
    layer_ids = real_target.default_layer_ids(5)
    assert layer_ids == [1, 8, 14, 20, 27]  # L = 30
    h = real_target.config.hidden_size
    for q in ["Write a haiku about the sea.", "What is 12 times 7?", "Explain photosynthesis in two sentences."]:
        ids = torch.tensor([encode_chat(tokenizer, q)])
        pos = torch.arange(ids.shape[1])[None]
        with torch.no_grad():
            ref = hf_real(ids, output_hidden_states=True)
            ours = real_target(ids, pos, capture_layer_ids=layer_ids)
        assert ours.logits.dtype == torch.float32 and ours.logits.shape == ref.logits.shape
        assert (ours.logits - ref.logits).abs().max() < 1e-3
        assert torch.equal(ours.logits.argmax(-1), ref.logits.argmax(-1))
        assert ours.features.shape == (1, ids.shape[1], len(layer_ids) * h)
        for j, i in enumerate(layer_ids):
            mine = ours.features[..., j * h:(j + 1) * h]
            # the residual stream carries outliers of ~2.5e4: compare per position, relative to its norm
            assert _rel_err(mine, ref.hidden_states[i + 1]).max() < 1e-5, i  # measured <= 4e-6
            assert _rel_err(mine, ref.hidden_states[i]).mean() > 1e-2, i  # the off-by-one would show
        # HF's last hidden_states entry is after the final norm
        assert _rel_err(ours.last_hidden, ref.hidden_states[-1]).max() < 1e-5


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-position relative L2 error ``[..., H] -> [...]``."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def test_real_target_incremental_cache_equals_full(real_target, tokenizer):
    """Prefix, then the suffix through the KV cache (one query at a time and one chunk) == one full forward."""
    ids = torch.tensor([encode_chat(tokenizer, "Why is the sky blue?") + [504, 6147, 282, 260]])
    t, split = ids.shape[1], 20
    layer_ids = real_target.default_layer_ids(5)
    with torch.no_grad():
        full = real_target(ids, torch.arange(t)[None], capture_layer_ids=layer_ids)
        cache = real_target.new_kv_cache(num_slots=3, max_seq_len=64)
        slot = torch.tensor([2])
        real_target(ids[:, :split], torch.arange(split)[None], cache=cache, slot_ids=slot, capture_layer_ids=layer_ids)
        chunk = real_target(ids[:, split:], torch.arange(split, t)[None], cache=cache, slot_ids=slot,
                            capture_layer_ids=layer_ids)
        # the chunk again, token by token, over the same cache (rewrites the same entries)
        steps = [real_target(ids[:, p:p + 1], torch.tensor([[p]]), cache=cache, slot_ids=slot,
                             capture_layer_ids=layer_ids) for p in range(split, t)]
    torch.testing.assert_close(chunk.logits, full.logits[:, split:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunk.features, full.features[:, split:], rtol=1e-4, atol=1e-4)
    step_logits = torch.cat([s.logits for s in steps], 1)
    torch.testing.assert_close(step_logits, full.logits[:, split:], rtol=1e-4, atol=1e-4)
    assert not cache.k[:, :2].any()  # other slots untouched


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_tiny_target_matches_transformers(tmp_path, model_type):
    """Save our random tiny model as an HF dir; transformers' Qwen2/Qwen3/Llama class and ours agree."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ours = make_tiny_target(model_type, seed=3)
    c = ours.config
    cfg = {"architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                              "llama": "LlamaForCausalLM"}[model_type]],
           "model_type": model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"}, "hidden_act": "silu",
           "max_position_embeddings": 256, "tie_word_embeddings": False, "attention_bias": c.attention_bias,
           "eos_token_id": 5, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = TargetModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.config.qk_norm == (model_type == "qwen3")
    assert loaded.config.attention_bias == (model_type == "qwen2")
    assert loaded.config.eos_token_ids == [5]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == cfg["architectures"][0]
    ids = torch.randint(0, c.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out = loaded(ids, torch.arange(23).expand(2, 23)).logits
        direct = ours(ids, torch.arange(23).expand(2, 23)).logits
    assert torch.equal(out, direct)
    assert ref.abs().max() > 1.0  # not a degenerate model
    assert (out - ref).abs().max() < 1e-4


def test_target_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        TargetModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'"):
        TargetModel.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------------- layer ids
def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B: 1 + 8i
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # 1 + 6.5i, Python round: 7.5->8, 20.5->20
    assert default_target_layer_ids(28, 3) == [1, 13, 25]
    assert default_target_layer_ids(30, 1) == [15]
    for num_layers in range(4, 64):
        for k in range(2, 8):
            expect = [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]
            got = default_target_layer_ids(num_layers, k)
            assert got == expect == config_default_layer_ids(num_layers, k)
            assert got[0] == 1 and got[-1] == num_layers - 3


# ----------------------------------------------------------------------------------- drafter
@pytest.mark.parametrize("mask_token_id", [None, 7])
def test_drafter_train_and_inference_attention_agree(tiny_target, mask_token_id):
    """forward_train's block at anchor a == propose_hidden with the context cache filled with positions < a."""
    drafter, _ = make_drafter(tiny_target, block_size=5, layers=2, policy="fixed", mask_token_id=mask_token_id)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random norms too, so a name mix-up between q_norm/k_norm/hidden_norm would show
        for n, p in drafter.named_parameters():
            if n.endswith("norm.weight") or n == "mask_embedding":
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    t = 30
    ids = torch.randint(0, 128, (1, t), generator=g)
    with torch.no_grad():
        feats = tiny_target(ids, torch.arange(t)[None], capture_layer_ids=drafter.config.target_layer_ids).features
        anchors = torch.tensor([[1, 4, 11, 12, 25]])
        train = drafter.forward_train(feats, ids, anchors)  # [1, N, bs, H]
        assert train.shape == (1, 5, 5, 32)
        for n, a in enumerate(anchors[0].tolist()):
            cache = drafter.new_context_cache(num_slots=2, max_seq_len=64)
            cache.k.normal_()  # garbage at and beyond the anchor must stay invisible
            cache.v.normal_()
            drafter.append_context(cache, torch.ones(a, dtype=torch.long), torch.arange(a), feats[0, :a])
            inf = drafter.propose_hidden(cache, torch.tensor([1]), ids[0, a:a + 1], torch.tensor([a]), span=40)
            torch.testing.assert_close(inf[0], train[0, n], rtol=1e-4, atol=1e-4)
        # batched inference over two slots with different anchors == one at a time
        cache = drafter.new_context_cache(num_slots=2, max_seq_len=64)
        drafter.append_context(cache, torch.tensor([0] * 11 + [1] * 25),
                               torch.cat([torch.arange(11), torch.arange(25)]), torch.cat([feats[0, :11], feats[0, :25]]))
        both = drafter.propose_hidden(cache, torch.tensor([0, 1]), ids[0, [11, 25]], torch.tensor([11, 25]))
    torch.testing.assert_close(both[0], train[0, 2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1], train[0, 4], rtol=1e-4, atol=1e-4)
    # the block input: anchor embedding then MASK (learned or the reserved id's embedding)
    emb = drafter.block_embeddings(torch.tensor([3]))[0]
    assert torch.equal(emb[0], tiny_target.model.embed_tokens.weight[3])
    mask = drafter.mask_embedding if mask_token_id is None else tiny_target.model.embed_tokens.weight[mask_token_id]
    assert torch.equal(emb[1:], mask.expand(4, -1))
    state = drafter.drafter_state_dict()
    assert ("mask_embedding" in state) == (mask_token_id is None)
    assert not any("embed_tokens" in k or "lm_head" in k for k in state)


# ----------------------------------------------------------------------------------- length head
def test_ratio_to_draft_len_hand_values():
    r = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.7, 1.0])
    # width = round(r * 16 * 1.3) = [0, 2, 5, 10, 15, 21]; γ = clamp(width - 1, 1, 15)
    assert ratio_to_draft_len(r, 16, 1.3, 1).tolist() == [1, 1, 4, 9, 14, 15]
    assert ratio_to_draft_len(r, 16, 1.3, 3).tolist() == [3, 3, 4, 9, 14, 15]
    assert ratio_to_draft_len(r, 8, 1.0, 1).tolist() == [1, 1, 1, 3, 5, 7]  # widths 0, 1, 2, 4, 6, 8
    assert ratio_to_draft_len(r, 16, 1.3, 1).dtype == torch.long
    a = torch.tensor([0, 3, 14, 15])
    torch.testing.assert_close(direct_length_label(a, 16, 1), torch.tensor([1 / 16, 0.25, 15 / 16, 1.0]))
    torch.testing.assert_close(direct_length_label(a, 16, 0), torch.tensor([0.0, 3 / 16, 14 / 16, 15 / 16]))


def test_direct_head_output_in_unit_interval():
    torch.manual_seed(0)
    head = DirectLengthHead(32, 256)
    x = torch.randn(3, 7, 16, 32) * 10  # [..., block_size, H]
    r = head(x)
    assert r.shape == (3, 7) and r.dtype == torch.float32
    assert bool(((r > 0) & (r < 1)).all()) and r.std() > 0
    # feature = [mean over positions, last position]: permuting the non-last positions changes nothing
    perm = torch.cat([torch.randperm(15), torch.tensor([15])])
    torch.testing.assert_close(head(x[..., perm, :]), r)
    assert not torch.allclose(head(x.flip(-2)), r)


# ----------------------------------------------------------------------------------- checkpoints
@pytest.fixture
def drafter_and_tensors(tiny_target):
    drafter, head = make_drafter(tiny_target, block_size=4, layers=2, policy="direct", seed=5)
    tensors = dict(drafter.drafter_state_dict())
    tensors.update({f"length_head.{k}": v for k, v in head.state_dict().items()})
    return drafter, head, tensors


def test_drafter_checkpoint_round_trip(tmp_path, tiny_target, drafter_and_tensors):
    drafter, head, tensors = drafter_and_tensors
    cfg = drafter.config
    sha = save_drafter_checkpoint(tmp_path / "ckpt", cfg, tensors, metadata={"version": 3, "train_step": 40})
    assert sha == tensors_sha256(tensors) == tensors_sha256({k: v.clone() for k, v in tensors.items()})
    assert len(sha) == 64
    cfg2, tensors2, meta = load_drafter_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg
    assert sorted(tensors2) == sorted(tensors)
    for k, v in tensors.items():
        assert tensors2[k].dtype == v.dtype and torch.equal(tensors2[k], v), k
    assert meta == {"version": "3", "train_step": "40", "sha256": sha}
    assert tensors_sha256(tensors2) == sha
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["dflash_config"] == {"block_size": 4, "mask_token_id": None, "target_layer_ids": [1, 2]}
    assert hf["block_size"] == 4 and hf["num_target_layers"] == 4 and hf["num_hidden_layers"] == 2
    # overwrite in place, and any change of a value changes the digest
    t3 = dict(tensors)
    t3["fc.weight"] = tensors["fc.weight"].clone()
    t3["fc.weight"][0, 0] += 1e-3
    assert save_drafter_checkpoint(tmp_path / "ckpt", cfg, t3) != sha
    assert torch.equal(load_drafter_checkpoint(tmp_path / "ckpt")[1]["fc.weight"], t3["fc.weight"])
    # build_drafter from the checkpoint reproduces the weights (drafter and head)
    save_drafter_checkpoint(tmp_path / "ckpt", cfg, tensors)
    d2, h2 = build_drafter(tiny_target, None, _ns(policy="direct", hidden_size=256), init_path=tmp_path / "ckpt")
    assert all(torch.equal(d2.drafter_state_dict()[k], tensors[k]) for k in d2.drafter_state_dict())
    assert all(torch.equal(v, tensors[f"length_head.{k}"]) for k, v in h2.state_dict().items())
    # the direct head's checkpoint under the cost policy: refused, naming the policy mix-up
    with pytest.raises(CheckpointError, match="another policy's head than length_head.policy 'cost'"):
        build_drafter(tiny_target, None, _ns(policy="cost", hidden_size=256), init_path=tmp_path / "ckpt")


def _ns(**kw):
    """The typed length-head section, as production builds it."""
    from adaflash_ray.config import LengthHeadConfig

    return LengthHeadConfig(**kw)


def test_drafter_checkpoint_corruption(tmp_path, drafter_and_tensors):
    drafter, _, tensors = drafter_and_tensors
    ckpt = tmp_path / "ckpt"
    save_drafter_checkpoint(ckpt, drafter.config, tensors)
    st = ckpt / "model.safetensors"
    raw = st.read_bytes()
    # truncated weights file
    st.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_drafter_checkpoint(ckpt)
    # same size, one value changed: caught by the stored sha256
    st.write_bytes(raw[:-4] + bytes(4))
    with pytest.raises(CheckpointError, match="sha256"):
        load_drafter_checkpoint(ckpt)
    st.write_bytes(raw)
    load_drafter_checkpoint(ckpt)
    # corrupt / incomplete config.json
    good = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="config.json"):
        load_drafter_checkpoint(ckpt)
    d = json.loads(good)
    del d["dflash_config"]
    (ckpt / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        load_drafter_checkpoint(ckpt)
    # valid JSON of the wrong shape or types: a CheckpointError naming the field, not a TypeError / AttributeError
    # or a "576 != 576" mismatch later
    for bad, field in (([1, 2], "JSON object"), ({"hidden_size": str(d["hidden_size"])}, "hidden_size"),
                       ({"num_hidden_layers": True}, "num_hidden_layers"), ({"rms_norm_eps": -1}, "rms_norm_eps"),
                       ({"dflash_config": {**json.loads(good)["dflash_config"], "target_layer_ids": []}},
                        "target_layer_ids"),
                       ({"dflash_config": {**json.loads(good)["dflash_config"], "block_size": 1}}, "block_size"),
                       ({"dflash_config": [1]}, "dflash_config"), ({"num_attention_heads": 0}, "num_attention_heads"),
                       ({"hidden_size": "576", "head_dim": None}, "hidden_size")):
        (ckpt / "config.json").write_text(json.dumps(bad if isinstance(bad, list) else {**json.loads(good), **bad}))
        with pytest.raises(CheckpointError, match=field):
            load_drafter_checkpoint(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_drafter_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="not found"):
        load_drafter_checkpoint(tmp_path / "nowhere")


def test_build_drafter_refuses_foreign_checkpoint(tmp_path, tiny_target):
    other = make_tiny_target("llama", vocab_size=96)
    drafter, _ = make_drafter(other, block_size=4, policy="fixed")
    save_drafter_checkpoint(tmp_path / "c", drafter.config, drafter.drafter_state_dict())
    with pytest.raises(CheckpointError, match="vocab_size 96 != target vocab_size 128"):
        build_drafter(tiny_target, None, _ns(policy="fixed"), init_path=tmp_path / "c")


# ----------------------------------------------------------------------------------- engine refuses bad drafters
def test_engine_refuses_mismatched_drafter(tiny_target, drafter_and_tensors):
    """A drafter for another vocabulary / width, mis-shaped, incomplete or NaN tensors, or a wrong sha256
    are refused with CheckpointError; the loaded version, checksum, weights and outputs stay."""
    drafter, head, tensors = drafter_and_tensors
    engine = SpecEngine(tiny_target, drafter, head, policy="direct", max_batch_size=4, max_seq_len=64,
                        drafter_version=7)
    sha0 = engine.drafter_sha256
    assert sha0 == tensors_sha256(tensors)
    before = {k: v.clone() for k, v in engine.drafter_tensors().items()}
    cfg = drafter.config
    new = {k: v + 0.01 for k, v in tensors.items()}  # a valid set of tensors
    bad_cfgs = {
        "vocab_size": DrafterModelConfig(**{**cfg.as_dict(), "vocab_size": 256}),
        "hidden_size": DrafterModelConfig(**{**cfg.as_dict(), "hidden_size": 64, "target_hidden_size": 64}),
        "target_layer_ids": DrafterModelConfig(**{**cfg.as_dict(), "target_layer_ids": [1, 9]}),
        "block_size": DrafterModelConfig(**{**cfg.as_dict(), "block_size": 8}),
    }
    for field, bad in bad_cfgs.items():
        with pytest.raises(CheckpointError, match=field):
            engine.load_drafter(new, version=8, config=bad)
    misshaped = dict(new, **{"fc.weight": torch.zeros(32, 96)})
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(32, 96\), expected \(32, 64\)"):
        engine.load_drafter(misshaped, version=8)
    missing = {k: v for k, v in new.items() if k != "norm.weight"}
    with pytest.raises(CheckpointError, match="missing tensors"):
        engine.load_drafter(missing, version=8)
    nan = dict(new)
    nan["layers.1.mlp.up_proj.weight"] = new["layers.1.mlp.up_proj.weight"].clone()
    nan["layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        engine.load_drafter(nan, version=8)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        engine.load_drafter(new, version=8, sha256="0" * 64)
    assert engine.drafter_version == 7 and engine.drafter_sha256 == sha0 and engine.num_reloads == 0
    assert all(torch.equal(v, before[k]) for k, v in engine.drafter_tensors().items())
    # still lossless after the refusals; a valid load then goes through
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    ar = engine.generate(prompts, SamplingParams(max_new_tokens=12), mode="ar")
    assert [r.output_ids for r in outs] == [r.output_ids for r in ar]
    assert all(len(r.output_ids) == 12 for r in outs)
    assert engine.load_drafter(new, version=8, config=cfg) == tensors_sha256(new)
    assert engine.drafter_version == 8 and engine.num_reloads == 1


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_projections_same_model(model_type):
    """fuse_projections (the CUDA path's q/k/v and gate/up GEMMs): same logits, same state_dict names and
    values, and an in-place parameter update still reaches the fused weights (views, not copies)."""
    t = make_tiny_target(model_type, seed=1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        ref = t(ids, pos).logits
        sd = {k: v.clone() for k, v in t.state_dict().items()}
        t.fuse_projections().fuse_projections()  # idempotent
        torch.testing.assert_close(t(ids, pos).logits, ref, rtol=1e-5, atol=1e-5)
        assert set(t.state_dict()) == set(sd) and all(torch.equal(t.state_dict()[k], sd[k]) for k in sd)
        t.model.layers[1].self_attn.v_proj.weight.mul_(0.5)
        t.model.layers[2].mlp.up_proj.weight.mul_(0.5)
        changed = t(ids, pos).logits
        unfused = make_tiny_target(model_type, seed=1)
        unfused.model.layers[1].self_attn.v_proj.weight.mul_(0.5)
        unfused.model.layers[2].mlp.up_proj.weight.mul_(0.5)
        torch.testing.assert_close(changed, unfused(ids, pos).logits, rtol=1e-5, atol=1e-5)
        assert (changed - ref).abs().max() > 1e-3


def test_build_drafter_refuses_a_checkpoint_that_differs_from_the_recipe(tmp_path, tiny_target):
    """A checkpoint whose block_size / layers differ from the recipe's drafter section is refused, naming each
    field (before: the checkpoint silently won while the recipe's block_size still sized the engine)."""
    from adaflash_ray.config import DrafterConfig, LengthHeadConfig

    drafter, _ = make_drafter(tiny_target, block_size=4, layers=1, policy="fixed")
    save_drafter_checkpoint(tmp_path / "c", drafter.config, drafter.drafter_state_dict())
    same = DrafterConfig(block_size=4, num_hidden_layers=1, num_target_layers=2, target_layer_ids=[1, 2])
    build_drafter(tiny_target, same, LengthHeadConfig(policy="fixed"), init_path=tmp_path / "c")
    other = same.model_copy(update={"block_size": 8, "num_hidden_layers": 2})
    with pytest.raises(CheckpointError, match=r"drafter\.block_size 8 \(recipe\) != 4 \(checkpoint\); "
                                              r"drafter\.num_hidden_layers 2 \(recipe\) != 1"):
        build_drafter(tiny_target, other, LengthHeadConfig(policy="fixed"), init_path=tmp_path / "c")


def test_init_context_from_target_gives_the_target_layers_own_input(tiny_target):
    """drafter.init_context_from_target: with the deepest conditioning id just below the first copied layer, the
    drafter's context c = hidden_norm(fc(features)) equals that target layer's normed input (input_layernorm of the
    residual stream entering it), position by position."""
    from adaflash_ray.config import DrafterConfig, LengthHeadConfig
    from adaflash_ray.models.factory import build_drafter

    L, n = tiny_target.config.num_hidden_layers, 1
    ids = [0, L - n - 1]
    cfg = DrafterConfig(num_hidden_layers=n, block_size=4, num_target_layers=2, target_layer_ids=ids,
                        init_from_target=True, init_context_from_target=True)
    drafter, _ = build_drafter(tiny_target, cfg, LengthHeadConfig(policy="fixed"))
    layer = tiny_target.model.layers[L - n]
    seen = {}
    hook = layer.input_layernorm.register_forward_hook(lambda mod, args, out: seen.setdefault("h", out.detach().clone()))
    try:
        ids_t = torch.tensor([[3, 17, 42, 7, 99, 5]])
        with torch.no_grad():
            out = tiny_target(ids_t, torch.arange(6)[None], capture_layer_ids=ids)
            ctx = drafter.project_context(out.features)
            want = seen["h"]  # the layer's normed input, as the target computed it
    finally:
        hook.remove()
    assert torch.allclose(ctx, want, atol=1e-5, rtol=1e-4), (ctx - want).abs().max()
    with torch.no_grad():  # and a plain init_from_target keeps fc random: the context is something else
        plain, _ = build_drafter(tiny_target, cfg.model_copy(update={"init_context_from_target": False}),
                                 LengthHeadConfig(policy="fixed"))
        assert not torch.allclose(plain.project_context(out.features), want, atol=1e-2)


def test_init_from_target_widens_a_larger_mlp_without_changing_its_function(tiny_target):
    """drafter.intermediate_size above the target's: init_from_target copies the target's MLP into the leading
    channels and zeroes down_proj's extra columns, so each drafter MLP computes what the copied target layer's does
    (the extra channels are live: their gate/up rows are not zero)."""
    from adaflash_ray.config import DrafterConfig, LengthHeadConfig
    from adaflash_ray.models.factory import build_drafter

    L, inter = tiny_target.config.num_hidden_layers, tiny_target.config.intermediate_size
    cfg = DrafterConfig(num_hidden_layers=2, block_size=4, num_target_layers=2, target_layer_ids=[0, 1],
                        init_from_target=True, intermediate_size=2 * inter)
    drafter, _ = build_drafter(tiny_target, cfg, LengthHeadConfig(policy="fixed"))
    x = torch.randn(5, tiny_target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(drafter.layers):
        src = tiny_target.model.layers[L - 2 + i]
        assert layer.mlp.gate_proj.weight.shape[0] == 2 * inter
        with torch.no_grad():
            got, want = layer.mlp(x), src.mlp(x)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
        assert layer.mlp.down_proj.weight[:, inter:].abs().max() == 0
        assert layer.mlp.gate_proj.weight[inter:].abs().max() > 0
    with torch.no_grad():  # without the widening the wider MLP is fresh: another function
        plain = cfg.model_copy(update={"init_from_target": False})
        other, _ = build_drafter(tiny_target, plain, LengthHeadConfig(policy="fixed"))
        assert not torch.allclose(other.layers[0].mlp(x), tiny_target.model.layers[L - 2].mlp(x), atol=1e-3)
