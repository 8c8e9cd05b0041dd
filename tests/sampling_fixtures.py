"""A tiny-vocabulary target and drafters whose sampled distributions can be enumerated (shared by
tests/test_sampling.py and tests/test_batch_sampling.py)."""

from __future__ import annotations

import functools

import torch

from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import Transformer
from specpilot.runtime.sampling import SamplingParams, probabilities

V = 6
MASK = V - 1
PROMPT = (1, 2, 3)
K = 3  # drafts per chain step


def _config(vocab: int = V) -> ModelConfig:
    return ModelConfig(family="qwen3", vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, qk_norm=True, max_position_embeddings=64, bos_token_id=None,
                       eos_token_id=None)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class Tiny:
    """A V=6 target, a PARD drafter (its own causal LM) and a DFlash drafter, random weights (std
    0.5: the target's next-token distributions spread over every token)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.target = Transformer(_config()).eval()
        _randomize(self.target, 0)
        self.pard = Transformer(_config()).eval()
        _randomize(self.pard, 1)
        dcfg = DrafterConfig(kind="dflash", block_size=K + 1, mask_token_id=MASK, model=_config(),
                             target_layer_ids=(0,))
        self.dflash = DFlashDrafter(dcfg, embed=self.target.embed, head=self.target.head).eval()
        _randomize(self.dflash, 2)
        for module in (self.target, self.pard, self.dflash):
            module.to(device)

    @functools.lru_cache(maxsize=None)
    def logits(self, continuation: tuple[int, ...]) -> torch.Tensor:
        """The target's logits after PROMPT + continuation (one teacher-forced forward)."""
        ids = torch.tensor([PROMPT + continuation], device=self.device)
        with torch.inference_mode():
            return self.target(ids, self.target.new_cache(1, ids.shape[1]), only_last=True).logits[0, -1].cpu()

    def next_probs(self, params: SamplingParams):
        return lambda seq: probabilities(self.logits(seq), params)

    def pard_q(self, params: SamplingParams, continuation: tuple[int, ...]) -> torch.Tensor:
        """The PARD drafter's q_i [K, V] after PROMPT + continuation (what generate_pard drafts from)."""
        ids = torch.tensor([PROMPT + continuation + (MASK,) * (K - 1)])
        with torch.inference_mode():
            logits = self.pard(ids, self.pard.new_cache(1, ids.shape[1])).logits[0, -K:]
        return probabilities(logits, params)
