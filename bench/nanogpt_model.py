"""The self-contained nanoGPT-style GPT the benchmarks' plain loops train (the reference they compare with)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def build_nanogpt(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> nn.Module:
    """A pre-LayerNorm GPT with learned positions and tied embeddings, initialised N(0, 0.02).

    ``model(tokens, labels)`` takes ``[b, s]`` token and label ids and returns the mean cross-entropy loss
    (a scalar); nanoGPT's model.py is the pattern.
    """

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):  # x: [b, s, h]
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens, labels):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.view(-1, vocab), labels.reshape(-1))

    return GPT()
