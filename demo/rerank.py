"""``tiny-rerank``: a 2-layer random-weight BERT cross-encoder (a sequence classifier with one
label, as sentence-transformers' ``CrossEncoder`` saves a reranker, its sigmoid named in the
config), with tiny-embed's offline WordPiece tokenizer, built from a seed."""

from __future__ import annotations

from pathlib import Path

import torch

from demo.embed import _CORPUS, tiny_bert


def build_demo(out_dir: Path, seed: int = 0) -> Path:
    """Save ``tiny-rerank`` to ``out_dir``: cross-encoder (``save_pretrained``) and tokenizer."""
    model, tokenizer = tiny_bert(Path(out_dir), seed, num_labels=1,
                                       sentence_transformers={"activation_fn": "torch.nn.modules.activation.Sigmoid"})
    _spread(model, tokenizer)
    model.save_pretrained(out_dir)
    return out_dir


def _spread(model, tokenizer) -> None:
    """Point the random head along the direction in which the pooled outputs of sample pairs
    differ most, centred and scaled so their logits span about -3..3: a random head reads mostly
    what every input shares, and scores every pair alike (0.61 +- 0.002)."""
    texts = sorted(set(_CORPUS))
    pairs = [(a, b) for a in texts for b in texts]
    enc = tokenizer([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        pooled = model.bert(**enc).pooler_output
        centred = pooled - pooled.mean(dim=0)
        direction = torch.linalg.svd(centred, full_matrices=False).Vh[0]
        logits = centred @ direction
        scale = 3.0 / logits.abs().max()
        model.classifier.weight.copy_((direction * scale).unsqueeze(0))
        model.classifier.bias.fill_(float(-(pooled.mean(dim=0) @ direction) * scale))
