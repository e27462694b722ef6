"""Shared fixtures of the model and engine tests.

- ``real_model_dir`` / ``real_target`` / ``tokenizer`` / ``chat_prompts``: SmolLM2-135M-Instruct from
  ``adaflash_ray.data.ensure_target`` (converted once and cached), loaded once per session, float32.
- ``tiny_target`` (+ ``make_tiny_target`` for the qwen2 / qwen3 / small-vocabulary variants): random
  decoders built from a :class:`TargetConfig`, every parameter (norms and biases included) random.
- ``make_drafter(target, block_size=..., layers=1, policy="direct")``: a random DFlash drafter (+ head)
  through ``adaflash_ray.models.factory.build_drafter``, the path the engine and trainer use.

Run: python -m pytest -q tests/test_models.py tests/test_engine.py
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

from adaflash_ray.config import DrafterConfig, LengthHeadConfig  # noqa: E402
from adaflash_ray.models.factory import build_drafter  # noqa: E402
from adaflash_ray.models.target import TargetConfig, TargetModel  # noqa: E402

torch.set_num_threads(1)

REAL_MODEL = "smollm2-135m-instruct"

# Short user turns whose greedy answers run for 64+ tokens (and one that hits EOS early).
CHAT_QUESTIONS = [
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What is the capital of France?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Write a short story about a robot learning to paint.",
]


@pytest.fixture(scope="session")
def real_model_dir():
    """The Hugging Face safetensors dir of SmolLM2-135M-Instruct (skips if its data package is absent)."""
    from adaflash_ray.data import MissingDataPackageError, ensure_target

    try:
        return ensure_target(REAL_MODEL)
    except MissingDataPackageError as e:
        pytest.skip(f"real target unavailable: {e}")


@pytest.fixture(scope="session")
def real_target(real_model_dir) -> TargetModel:
    return TargetModel.from_pretrained(real_model_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


def encode_chat(tokenizer, question: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """The 8 :data:`CHAT_QUESTIONS` as chat-templated token ids (34-40 tokens each)."""
    return [encode_chat(tokenizer, q) for q in CHAT_QUESTIONS]


# ---------------------------------------------------------------------- tiny random targets
def tiny_config(model_type: str = "llama", vocab_size: int = 128, **overrides) -> TargetConfig:
    """Vocab 128, hidden 32, 4 layers, 4 heads / 2 kv heads, head_dim 8; qwen2 gets q/k/v biases,
    qwen3 q/k norms (as :meth:`TargetConfig.from_hf_dict` would set them)."""
    kw = dict(model_type=model_type, vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, attention_bias=model_type == "qwen2",
              qk_norm=model_type == "qwen3")
    kw.update(overrides)
    return TargetConfig(**kw)


def make_tiny_target(model_type: str = "llama", vocab_size: int = 128, seed: int = 0,
                     dtype: torch.dtype = torch.float32, logit_scale: float = 1.0, **overrides) -> TargetModel:
    """A random tiny target, deterministic in ``seed``. Norm weights ~ 1 + 0.1·N(0,1), biases ~ 0.1·N(0,1),
    matrices ~ N(0, 1/fan_in) (embeddings N(0,1)); ``logit_scale`` multiplies lm_head (peakier output)."""
    cfg = tiny_config(model_type, vocab_size, **overrides)
    g = torch.Generator().manual_seed(seed)
    model = TargetModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        model.lm_head.weight.mul_(logit_scale)
    return model.to(dtype).requires_grad_(False).eval()


@pytest.fixture(scope="session")
def tiny_target() -> TargetModel:
    """Random Llama-style tiny target (see :func:`tiny_config`). Session-scoped: do not modify it."""
    return make_tiny_target("llama")


# ---------------------------------------------------------------------- drafters
def make_drafter(target: TargetModel, block_size: int = 16, layers: int = 1, policy: str = "direct",
                 target_layer_ids: list[int] | None = None, mask_token_id: int | None = None, seed: int = 0,
                 head_prior: bool = False, init_from_target: bool = False):
    """A DFlash drafter (+ head, None for ``fixed``) via ``build_drafter`` from the same typed recipe sections
    (``DrafterConfig`` / ``LengthHeadConfig``) the engine and trainer use. Tiny targets (< 8 layers) default
    to ``target_layer_ids = [1, L-2]``. ``init_from_target=False`` (a test choice, stated here; recipes default
    to True) keeps the drafter fully random, so its proposals are rarely right. ``head_prior=False`` replaces
    the head's prior init (constant γ = min_len) with random output weights, so the engine sees varying γ."""
    num_layers = target.config.num_hidden_layers
    if target_layer_ids is None and num_layers < 8:
        target_layer_ids = [1, num_layers - 2]
    num_target_layers = len(target_layer_ids) if target_layer_ids is not None else 5
    drafter_cfg = DrafterConfig(num_hidden_layers=layers, block_size=block_size, num_target_layers=num_target_layers,
                                target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
                                init_from_target=init_from_target)
    head_cfg = LengthHeadConfig(policy=policy)
    drafter, head = build_drafter(target, drafter_cfg, head_cfg, seed=seed)
    drafter.requires_grad_(False)
    if head is not None:
        head.requires_grad_(False)
        if not head_prior:
            g = torch.Generator().manual_seed(seed + 7)
            with torch.no_grad():
                head.out.weight.copy_(torch.randn(head.out.weight.shape, generator=g) * 0.5)
                head.out.bias.zero_()
    return drafter, head


def greedy_reference(target: TargetModel, prompt: list[int], num_new: int, stop: set[int] = frozenset()) -> list[int]:
    """Slow oracle: greedy decoding by a full (cache-free) forward per token."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_new):
            x = torch.tensor([ids])
            tok = int(target(x, torch.arange(len(ids))[None]).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok in stop:
                break
    return out


# ---------------------------------------------------------------------- the fast subset: -m "not slow"
#: fixtures that load the real model's weights, start Ray or start a server: the tests using them are ``slow``
SLOW_FIXTURES = frozenset({"real_target", "hf_real", "gguf_model", "gpu_target", "real_ar", "ray_local", "workers",
                           "server", "client"})
#: test files whose every test runs whole jobs, Ray clusters or processes of their own
SLOW_FILES = frozenset({"test_pipeline.py", "test_faults.py", "test_golden.py", "test_weight_sync.py",
                        "test_fidelity.py"})


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` every test of :data:`SLOW_FILES` and every test that uses a :data:`SLOW_FIXTURES` fixture, so
    ``python -m pytest -q -m "not slow"`` runs the unit tests on tiny random models and fakes alone; skip the ``long``
    tests unless ``ADAFLASH_LONG_TESTS=1`` (the default command, CI's, stays within its time box)."""
    run_long = os.environ.get("ADAFLASH_LONG_TESTS") == "1"
    for item in items:
        if item.path.name in SLOW_FILES or SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if not run_long and item.get_closest_marker("long") is not None:
            item.add_marker(pytest.mark.skip(reason="a long end-to-end variant: ADAFLASH_LONG_TESTS=1 runs it"))
