"""A GRU sequence classifier on generated token sequences: recall the token ``lag`` steps back.

The input is a sequence of ``T`` token ids (``nn.Embedding`` reads them as integers: they are never
cast to float), the output one class distribution per position, shaped ``(N, T, vocab)``; the
likelihood observes every position and a sequence's log density is the sum over its positions. The
recurrent layer (``nn.GRU``) cannot be batched over weight draws by ``torch.func.vmap``: predictions
loop over draws in bounded chunks (docs/guide/models.md, "Sequence and embedding models").

The card's SVI default reaches a test accuracy far above the most frequent label's and the copy-the-current-token
rule's; NUTS runs on the compiled log density (``jit=True``, the default; much slower per leapfrog step without it),
and the card's 100 + 100 draws at depth 5 take minutes. Measured figures:
benchmarks/results/docstring_figures/results.md.
"""

import torch
from torch import nn

import bnn_pyro as bp
from bnn_pyro.data.zoo import Entry, fit_defaults

CARD = {
    "title": "GRU sequence classifier (lagged recall of generated tokens)",
    "summary": "A Bayesian recurrent net on integer token sequences: Embedding -> GRU -> Linear, one class "
    "distribution per position ((N, T, vocab) outputs). Task: at step t output the token seen lag steps "
    "earlier (the first token while fewer than lag have been seen), which needs memory; a trivial "
    "baseline (the most frequent label, or copying the current token) gets about 1/vocab.",
    "prior": "Normal(0, 1) on every weight (embedding, GRU gates, output layer): wide enough for gate "
    "pre-activations of order one with 16 hidden units, and a proper prior for every engine.",
    "likelihood": "Categorical(logits = net(x)) at every position: y shaped (N, T) holds integer labels; a "
    "sequence's log-likelihood is the sum over its T positions.",
    "default_method": "svi",
    "default_settings": {
        "svi": {"guide": "mean_field", "num_steps": 400, "lr": 0.03, "num_samples": 100},
        "nuts": {"num_samples": 100, "num_warmup": 100, "num_chains": 1, "max_tree_depth": 5},
    },
    "data": "Generated: token ids drawn uniformly from 0..vocab-1 (vocab=4), sequences of length T=10, labels "
    "y_t = x_{max(t - lag, 0)} with lag=2; 200 training sequences (torch.Generator seeded with seed) and "
    "300 test sequences (seed + 1).",
    "references": [
        "Cho, K. et al. (2014). Learning phrase representations using RNN encoder-decoder for statistical "
        "machine translation. EMNLP (the GRU).",
        "Fortunato, M., Blundell, C. & Vinyals, O. (2017). Bayesian recurrent neural networks. arXiv:1704.02798.",
        "Gal, Y. & Ghahramani, Z. (2016). A theoretically grounded application of dropout in recurrent "
        "neural networks. NeurIPS.",
    ],
}


class GRUTagger(nn.Module):
    """Token ids ``(N, T)`` -> logits ``(N, T, vocab)``: Embedding, one GRU layer, a Linear read-out."""

    def __init__(self, vocab: int, embed: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(tokens))
        return self.out(h)


def lagged_recall(n: int, *, length: int = 10, vocab: int = 4, lag: int = 2, seed: int = 0):
    """``n`` sequences of token ids ``(n, length)`` (int64) and their labels ``y_t = x_{max(t - lag, 0)}``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(vocab, (n, length), generator=g)
    source = (torch.arange(length) - lag).clamp_min(0)
    return x, x[:, source]


def build(
    *, vocab: int = 4, length: int = 10, lag: int = 2, hidden: int = 16, embed: int = 8, n: int = 200, seed: int = 0
) -> Entry:
    x, y = lagged_recall(n, length=length, vocab=vocab, lag=lag, seed=seed)
    x_test, y_test = lagged_recall(300, length=length, vocab=vocab, lag=lag, seed=seed + 1)
    torch.manual_seed(seed)
    model = bp.BNN(
        GRUTagger(vocab, embed, hidden), prior=bp.priors.Normal(0.0, 1.0), likelihood=bp.likelihoods.Categorical()
    )
    defaults = fit_defaults(CARD, seed=seed)
    return Entry(
        name="gru_sequence",
        model=model,
        x=x,
        y=y,
        x_test=x_test,
        y_test=y_test,
        task="classification",
        fit_defaults=defaults,
        card=CARD,
    )
