"""Choose the next token from the last position's logits: greedy, temperature, top-k and top-p (nucleus) sampling."""
from typing import Optional

import torch


def sample_logits(
    logits: torch.Tensor,
    greedy: bool = False,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next-token ids ``[b]`` (int64) from logits ``[b, V]`` (V = the padded vocabulary, any float dtype).

    Args:
        logits: unnormalised scores of the last position, ``[b, V]``; not modified.
        greedy: take the argmax (ties go to the lowest id, as ``torch.argmax``); the other options are ignored.
        top_k: keep the ``k`` highest-scoring ids before sampling (Fan et al. 2018, "Hierarchical Neural
            Story Generation", section 5.4); 0 keeps all. Ties at the k-th score are all kept.
        top_p: keep the smallest set of highest-probability ids whose probability sums to at least
            ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", section 3.1);
            0.0 (or 1.0) keeps all. Applied after top-k, on the temperature-scaled distribution.
        temperature: the logits are divided by it before top-k/top-p and sampling; must be > 0.
        vocab_size: ids ``>= vocab_size`` (the padding rows of the embedding) are never chosen.
        generator: the random stream for sampling (``torch.multinomial``); None uses the default one.

    Returns the chosen ids ``[b]`` on the device of ``logits``.

    Raises ValueError for ``temperature <= 0``, ``top_k < 0``, ``top_p`` outside [0, 1], a ``vocab_size``
    outside [1, V], or logits that are not 2-D.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [b, V], got shape {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p}")
    if vocab_size is not None and not 1 <= vocab_size <= logits.size(-1):
        raise ValueError(f"vocab_size {vocab_size} is not in [1, {logits.size(-1)}] (the logits' last dimension)")

    scores = logits.float()  # a copy: the filters below write -inf in place
    if vocab_size is not None and vocab_size < scores.size(-1):
        scores[:, vocab_size:] = float("-inf")
    if greedy:
        return torch.argmax(scores, dim=-1)

    scores = scores / temperature
    if 0 < top_k < scores.size(-1):
        kth_best = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop an id when the ids ranked above it already reach top_p: the first id always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)
